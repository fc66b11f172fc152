"""Pipeline models as ordered layer lists (`LayerStack`), and the built-in GPT.

A `LayerStack` is what the executor needs from a model: how many layers, how to build layer
``i`` (so a rank materialises only its own stages), each layer's parameter count (for
partitioning by parameters) and the loss. The model's shape is pipesim's `ModelSpec` (the
plan's); `gpt_stack` builds the built-in GPT of one, `pipeexec.models.layer_stack` picks the
built-in GPT or a Hugging Face family for a run. Layer ``i`` is initialised from a generator seeded by
``(seed, i)``: the same seed gives the same model whatever the layout. Parameters are named
``layers.<global index>.<name>`` everywhere (state dicts, optimizer state), so a checkpoint can
be resharded across layouts.

Contract: layer 0 takes the microbatch input, every layer returns one tensor, the last layer's
output goes to ``loss_fn(output, target)`` which returns the mean loss of the microbatch.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .parallel import context, regions
from .parallel.context import ContextParallel
from .parallel.layers import (ColumnParallelLinear, RowParallelLinear, vocab_parallel_cross_entropy,
                              vocab_parallel_embedding)
from .parallel.regions import NONE, TensorParallel
from .parallel.sharding import ShardSpec, mark, shard

LayerFactory = Callable[[int, torch.Generator], nn.Module]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def layer_seed(seed: int, index: int) -> int:
    """A generator seed for layer ``index`` that depends only on (seed, index)."""
    return (seed * 1_000_003 + index * 7_919 + 12_345) % (2 ** 63 - 1)


@dataclass(frozen=True)
class LayerStack:
    num_layers: int
    factory: LayerFactory                   # (global index, generator) -> initialised layer
    loss_fn: LossFn
    param_counts: tuple[int, ...] | None = None   # per layer; measured on demand when None
    # per layer: what it is ("embedding", "block", "head"...); layers of one kind are assumed to
    # cost the same when calibrated costs are re-partitioned. None: every layer its own
    # factory's class name (`kinds`).
    layer_kinds: tuple[str, ...] | None = None
    # (alias, canonical) global parameter names: the alias is the same parameter as the
    # canonical one (e.g. an output layer tied to the input embedding); the trainer starts it
    # from the canonical instance's value and keeps the two equal (`pipeexec.training.tied`).
    tied: tuple[tuple[str, str], ...] = ()
    # transformer blocks between an embedding (layer 0) and a head (the last layer), as a
    # plan counts layers; None: a plain list, cut evenly as it is (`pipeexec.partition`)
    blocks: int | None = None

    def __post_init__(self) -> None:
        if self.layer_kinds is not None and len(self.layer_kinds) != self.num_layers:
            raise ValueError(f"LayerStack: {len(self.layer_kinds)} layer kinds for "
                             f"{self.num_layers} layers")
        aliases = dict(self.tied)
        for alias, canonical in self.tied:
            if canonical in aliases:
                raise ValueError(f"LayerStack.tied: {alias!r} is tied to {canonical!r}, itself an "
                                 "alias; name the canonical parameter")

    def canonical(self, name: str) -> str:
        """The parameter ``name`` is an instance of (itself unless `tied` maps it)."""
        for alias, canonical in self.tied:
            if alias == name:
                return canonical
        return name

    def build_layer(self, index: int, seed: int, device: torch.device | str = "cpu",
                    dtype: torch.dtype | None = None) -> nn.Module:
        if not 0 <= index < self.num_layers:
            raise IndexError(f"layer {index} outside 0..{self.num_layers - 1}")
        gen = torch.Generator().manual_seed(layer_seed(seed, index))
        layer = self.factory(index, gen)
        return layer.to(device=device, dtype=dtype) if dtype is not None else layer.to(device)

    def layer_param_counts(self) -> tuple[int, ...]:
        if self.param_counts is not None:
            return self.param_counts
        counts = []
        for i in range(self.num_layers):
            layer = self.factory(i, torch.Generator().manual_seed(0))
            counts.append(sum(p.numel() for p in layer.parameters()))
        return tuple(counts)

    def kinds(self) -> tuple[str, ...]:
        """Each layer's kind: ``layer_kinds``, or the class name of the layer the factory
        builds (the kind a measured run records for re-partitioning its costs)."""
        if self.layer_kinds is not None:
            return self.layer_kinds
        return tuple(type(self.factory(i, torch.Generator().manual_seed(0))).__name__
                     for i in range(self.num_layers))


def model_from_layers(layers: list[nn.Module], loss_fn: LossFn) -> LayerStack:
    """A stack over an existing layer list (every rank holds the list; each uses its stages).

    For models too big to build everywhere, pass a factory to `LayerStack` instead.
    """
    def factory(index: int, generator: torch.Generator) -> nn.Module:
        return layers[index]
    counts = tuple(sum(p.numel() for p in layer.parameters()) for layer in layers)
    return LayerStack(len(layers), factory, loss_fn, counts,
                     tuple(type(layer).__name__ for layer in layers))


# -- built-in GPT ---------------------------------------------------------------------------------
def _normal(t: torch.Tensor, std: float, gen: torch.Generator) -> None:
    with torch.no_grad():
        t.copy_(torch.randn(t.shape, generator=gen) * std)


def _sequence_parallel_norm(norm: nn.LayerNorm, tp: TensorParallel) -> nn.LayerNorm:
    """A norm fed one sequence chunk per rank: its gradients are summed over tp."""
    if tp.active and tp.sequence_parallel:
        for p in norm.parameters():
            mark(p, sequence_parallel=True)
    return norm


class Embedding(nn.Module):
    """Token + learned position embeddings: (batch, seq) int64 -> (batch, seq, hidden).

    Tensor parallel: the token rows cut over the vocabulary (`vocab_parallel_embedding`), the
    position table replicated; under sequence parallelism the output is this rank's chunk.
    Context parallel: the tokens are this cp rank's two chunks of the sequence, each at its
    global positions (`context.local_positions`)."""

    def __init__(self, vocab: int, positions: int, hidden: int, gen: torch.Generator,
                 tp: TensorParallel = NONE, cp: ContextParallel = context.NONE) -> None:
        super().__init__()
        self.vocab, self.tp, self.cp = vocab, tp, cp
        tok = torch.empty(vocab, hidden)
        self.pos = nn.Parameter(torch.empty(positions, hidden))
        _normal(tok, 0.02, gen)
        _normal(self.pos, 0.02, gen)
        self.tok = nn.Parameter(tok)
        if tp.active:
            self.tok = mark(nn.Parameter(shard(tok, ShardSpec(0), tp.rank, tp.size)), ShardSpec(0))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        pos = (self.pos[context.local_positions(s, self.cp, tokens.device)] if self.cp.active
               else self.pos[:s])
        x = vocab_parallel_embedding(tokens, self.tok, self.vocab, self.tp) + pos
        return regions.scatter_sequence(x, self.tp) if self.tp.sequence_parallel else x


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln1(x)), then x + mlp(ln2(x)); causal attention.

    Tensor parallel (Megatron's layout): QKV and fc1 column-parallel (QKV cut by heads), the
    output projection and fc2 row-parallel, the norms replicated (fed one sequence chunk a rank
    under sequence parallelism). Context parallel: the queries of this cp rank's chunks attend
    to the keys and values of the whole sequence (`context.context_parallel_attention`)."""

    def __init__(self, hidden: int, heads: int, ffn: int, num_blocks: int,
                 gen: torch.Generator, tp: TensorParallel = NONE,
                 cp: ContextParallel = context.NONE) -> None:
        super().__init__()
        if heads % tp.size or ffn % tp.size:
            raise ValueError(f"tensor parallelism: heads {heads} and ffn {ffn} must be multiples "
                             f"of tp = {tp.size}")
        self.heads, self.head_dim, self.tp, self.cp = heads, hidden // heads, tp, cp
        self.recompute_core_attention = False    # selective recomputation (Stage.set_recompute)
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)
        out_std = 0.02 / math.sqrt(2 * num_blocks)   # GPT-2's scaled init of residual outputs
        for lin, std in ((self.qkv, 0.02), (self.proj, out_std), (self.fc1, 0.02), (self.fc2, out_std)):
            _normal(lin.weight, std, gen)
            nn.init.zeros_(lin.bias)
        if tp.active:
            self.qkv = ColumnParallelLinear(self.qkv, tp, groups=3)
            self.proj = RowParallelLinear(self.proj, tp)
            self.fc1 = ColumnParallelLinear(self.fc1, tp)
            self.fc2 = RowParallelLinear(self.fc2, tp)
            _sequence_parallel_norm(self.ln1, tp)
            _sequence_parallel_norm(self.ln2, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(self.ln1(x))          # (b, s, 3 h / tp): whole sequence, local heads
        b, s, _ = qkv.shape
        heads = self.heads // self.tp.size
        q, k, v = qkv.view(b, s, 3, heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if self.cp.active:
            # (recomputes its core attention in the backward: selective recomputation's saving)
            a = context.context_parallel_attention(q, k, v, self.cp, context.sdpa)
        elif self.recompute_core_attention and torch.is_grad_enabled():
            a = checkpoint(_core_attention, q, k, v, use_reentrant=False)
        else:
            a = _core_attention(q, k, v)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, heads * self.head_dim))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def _core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax(q k^T / sqrt(d)) v: what selective recomputation recomputes."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Head(nn.Module):
    """Final LayerNorm + LM head: (batch, seq, hidden) -> logits (batch, seq, vocab); tensor
    parallel: the head column-parallel over the vocabulary, its logits left cut for
    `vocab_parallel_cross_entropy`."""

    def __init__(self, hidden: int, vocab: int, gen: torch.Generator,
                 tp: TensorParallel = NONE) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        _normal(self.lm_head.weight, 0.02, gen)
        if tp.active:
            self.lm_head = ColumnParallelLinear(self.lm_head, tp)
            _sequence_parallel_norm(self.norm, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32 (Float16Module casts outputs back)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def gpt_stack(model: Any, tp: TensorParallel = NONE,
              cp: ContextParallel = context.NONE) -> LayerStack:
    """The built-in GPT of ``model`` (a `pipesim.ModelSpec` of its shape, family None:
    `pipeexec.models.gpt_differences` says what it cannot be): [Embedding, Block x layers,
    Head], cross-entropy loss. A tied head (``model.tied_embeddings``, Megatron-LM's default,
    GPT-2's) starts as the token embedding and stays one parameter with it. ``tp``: this rank's
    tensor-parallel group; each layer is built whole and cut, the loss is vocab-parallel.
    ``cp``: this rank's context-parallel group (each rank's loss is the mean over its tokens,
    which are as many on every cp rank: the trainer averages over cp)."""
    layers, hidden, heads, vocab = model.layers, model.hidden, model.heads, model.vocab
    ffn, positions = model.ffn, model.max_position or model.seq_length

    def factory(index: int, gen: torch.Generator) -> nn.Module:
        if index == 0:
            return Embedding(vocab, positions, hidden, gen, tp, cp)
        if index == layers + 1:
            return Head(hidden, vocab, gen, tp)
        return Block(hidden, heads, ffn, layers, gen, tp, cp)

    block = 2 * 2 * hidden + (hidden * 3 * hidden + 3 * hidden) + (hidden * hidden + hidden) \
        + (hidden * ffn + ffn) + (ffn * hidden + hidden)
    counts = (vocab * hidden + positions * hidden,) + (block,) * layers + (2 * hidden + hidden * vocab,)
    tied = ((f"layers.{layers + 1}.lm_head.weight", "layers.0.tok"),) if model.tied_embeddings else ()
    loss = lm_loss if not tp.active else (
        lambda logits, targets: vocab_parallel_cross_entropy(logits, targets, vocab, tp))
    return LayerStack(layers + 2, factory, loss, counts,
                      ("embedding",) + ("block",) * layers + ("head",), tied=tied, blocks=layers)
