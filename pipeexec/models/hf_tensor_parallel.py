"""Tensor parallelism (with sequence parallelism) for the Hugging Face layers of `hf`: each
layer is built whole, as one process builds it (initialised, or loaded from the directory's
safetensors), then cut here the way Megatron-LM cuts a transformer layer. The family's own
modules and forward code stay; only their projections are replaced (or, for Mixtral's expert
tensors, re-cut) and their parameter names are kept, so `hf.hf_name` and checkpoints read the
same names.

* Embedding: the token rows cut over the vocabulary (`VocabParallelEmbedding`); GPT-2's
  position table replicated; under sequence parallelism `hf.HFEmbedding` keeps this rank's
  sequence chunk.
* Decoder layer: each norm's output enters the column-parallel region once
  (`regions.into_column`, a forward hook on the norm, as Transformer Engine's
  LayerNormColumnParallelLinear: under sp the all-gather of the sequence, else identity with
  the gradient all-reduced). Once, not in each projection: Hugging Face attention reshapes
  q, k and v by its input's length (``(*hidden_states.shape[:-1], -1, head_dim)``), so that
  input must already be the whole sequence. Then
  - Llama / Mistral / Qwen2 / Mixtral: q, k, v (Qwen2's biases too; GQA: the kv heads cut as
    the query heads, so rank r's query heads read its own kv heads) column-parallel, o_proj
    row-parallel; gate and up column-parallel, down row-parallel;
  - Qwen3-MoE: its per-head q and k norms replicated, their gradients summed over tp;
  - Mixtral, Qwen2-/Qwen3-MoE (sparse layers; dense ones as Llama's MLP): each expert's
    gate_up (two blocks, gate and up) cut by rows and down by columns,
    as a dense MLP without expert parallelism; the router replicated, reading the whole
    sequence, its gradient summed over tp after the backward (each rank's share of the
    experts' output gives it part of the routing weights' gradient; the mark is the one a
    sequence-parallel norm has); Qwen2-MoE's shared expert cut as a dense MLP (gate and up
    by rows, down by columns) whose partial output, times its replicated sigmoid gate
    (gradient summed over tp as the router's), joins the experts' partial sum; the block's
    partial sum leaves through `regions.out_of_row` (once);
  - GPT-2 (Conv1D: weight (in, out)): c_attn column-parallel as three blocks (q, k, v),
    c_fc column-parallel, both c_proj row-parallel (`ColumnParallelConv1D`,
    `RowParallelConv1D`);
  - the attention and experts read a per-layer config copy with the local head counts and
    sizes, and the attributes their forward reads (GPT-2's ``split_size``, ``num_heads``;
    the experts' ``intermediate_dim``) are the local ones; rotary positions stay the whole
    sequence's (`hf.HFDecoderLayer` makes them, and the mask, for the gathered length).
* Head: the final norm replicated, lm_head column-parallel over the vocabulary, its logits
  left cut for `vocab_parallel_cross_entropy`.

Under sequence parallelism the norms (and row-parallel biases) see one chunk a rank and are
marked `sequence_parallel`, so the trainer sums their gradients over tp.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ..parallel import regions
from ..parallel.layers import ColumnParallelLinear, RowParallelLinear, vocab_parallel_embedding
from ..parallel.regions import TensorParallel
from ..parallel.sharding import ShardSpec, mark, shard


def _cut(t: torch.Tensor, spec: ShardSpec, tp: TensorParallel) -> nn.Parameter:
    return mark(nn.Parameter(shard(t.detach(), spec, tp.rank, tp.size)), spec)


def _sequence_parallel(module: nn.Module, tp: TensorParallel) -> None:
    """``module``'s parameters see one sequence chunk a rank: gradients summed over tp."""
    if tp.sequence_parallel:
        for p in module.parameters():
            mark(p, sequence_parallel=True)


class _IntoColumn:
    """Forward hook: the module's output enters the column-parallel region."""

    def __init__(self, tp: TensorParallel) -> None:
        self.tp = tp

    def __call__(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return regions.into_column(output, self.tp)


class _OutOfRow:
    """Forward hook: the module's partial sums leave the tensor-parallel region."""

    def __init__(self, tp: TensorParallel) -> None:
        self.tp = tp

    def __call__(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return regions.out_of_row(output, self.tp)


class VocabParallelEmbedding(nn.Module):
    """An `nn.Embedding` whose rows are cut over tp (`vocab_parallel_embedding`): the whole
    embedding on every rank, ``padding_idx`` kept."""

    def __init__(self, full: nn.Embedding, tp: TensorParallel) -> None:
        super().__init__()
        self.tp, self.vocab, self.padding_idx = tp, full.num_embeddings, full.padding_idx
        self.weight = _cut(full.weight, ShardSpec(0), tp)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embedding(tokens, self.weight, self.vocab, self.tp, self.padding_idx)


class ColumnParallelConv1D(nn.Module):
    """GPT-2's Conv1D (``y = x W + b``, weight (in, out)) with its output features cut over
    tp, ``groups`` fused blocks (c_attn: q, k, v) each cut; its input already in the column
    region."""

    def __init__(self, full: nn.Module, tp: TensorParallel, *, groups: int = 1) -> None:
        super().__init__()
        self.weight = _cut(full.weight, ShardSpec(1, groups), tp)
        self.bias = _cut(full.bias, ShardSpec(0, groups), tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)
        return y.view(*x.shape[:-1], y.shape[-1])


class RowParallelConv1D(nn.Module):
    """GPT-2's Conv1D with its input features cut over tp: the partial products summed by
    `regions.out_of_row`, then the replicated bias added."""

    def __init__(self, full: nn.Module, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.weight = _cut(full.weight, ShardSpec(0), tp)
        self.bias = mark(nn.Parameter(full.bias.detach().clone()),
                         sequence_parallel=tp.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (x.reshape(-1, x.shape[-1]) @ self.weight).view(*x.shape[:-1], self.weight.shape[-1])
        return regions.out_of_row(y, self.tp) + self.bias


# -- the three kinds of layer ---------------------------------------------------------------
def cut_embedding(layer: nn.Module, model_type: str, tp: TensorParallel) -> nn.Module:
    """`hf.HFEmbedding`, cut: the token table vocab-parallel."""
    name = "wte" if model_type == "gpt2" else "embed_tokens"
    setattr(layer, name, VocabParallelEmbedding(getattr(layer, name), tp))
    layer.tp = tp
    return layer


def cut_head(layer: nn.Module, tp: TensorParallel) -> nn.Module:
    """`hf.HFHead`, cut: lm_head column-parallel over the vocabulary."""
    layer.lm_head = ColumnParallelLinear(layer.lm_head, tp)
    _sequence_parallel(getattr(layer, layer.norm_name), tp)
    return layer


def cut_decoder_layer(layer: nn.Module, model_type: str, tp: TensorParallel) -> nn.Module:
    """`hf.HFDecoderLayer`, cut as the module docstring says."""
    block, size = layer.block, tp.size
    local = copy.copy(layer.config)          # this layer's: the local head counts and sizes
    local.num_attention_heads = layer.config.num_attention_heads // size
    if model_type == "gpt2":
        norms = (block.ln_1, block.ln_2)
        attn, mlp = block.attn, block.mlp
        attn.c_attn = ColumnParallelConv1D(attn.c_attn, tp, groups=3)
        attn.c_proj = RowParallelConv1D(attn.c_proj, tp)
        attn.num_heads //= size
        attn.embed_dim //= size
        attn.split_size //= size             # c_attn's output split into q, k, v
        mlp.c_fc = ColumnParallelConv1D(mlp.c_fc, tp)
        mlp.c_proj = RowParallelConv1D(mlp.c_proj, tp)
    else:
        norms = (block.input_layernorm, block.post_attention_layernorm)
        attn = block.self_attn
        local.num_key_value_heads = layer.config.num_key_value_heads // size
        local.head_dim = attn.head_dim       # not hidden / local heads
        local.intermediate_size = layer.config.intermediate_size // size
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(attn, name, ColumnParallelLinear(getattr(attn, name), tp, entered=True))
        attn.o_proj = RowParallelLinear(attn.o_proj, tp)
        for name in ("q_norm", "k_norm"):    # Qwen3's per-head norms: replicated, read the
            if hasattr(attn, name):          # local heads, so their gradients are summed
                for p in getattr(attn, name).parameters():
                    mark(p, sequence_parallel=True)
        for name in ("num_heads", "num_key_value_heads"):    # older versions' attributes
            if hasattr(attn, name):
                setattr(attn, name, getattr(attn, name) // size)
        mlp = block.mlp
        if hasattr(mlp, "experts"):          # Mixtral, Qwen2-MoE's sparse layers
            experts = mlp.experts
            experts.gate_up_proj = _cut(experts.gate_up_proj, ShardSpec(1, 2), tp)
            experts.down_proj = _cut(experts.down_proj, ShardSpec(2), tp)
            experts.intermediate_dim //= size
            mark(mlp.gate.weight, sequence_parallel=True)   # partial gradient: summed over tp
            shared = getattr(mlp, "shared_expert", None)
            if shared is not None:
                # a dense MLP whose down projection's partial sum joins the experts' (one
                # reduction for the block); its sigmoid gate replicated, its gradient partial
                shared.gate_proj.weight = _cut(shared.gate_proj.weight, ShardSpec(0), tp)
                shared.up_proj.weight = _cut(shared.up_proj.weight, ShardSpec(0), tp)
                shared.down_proj.weight = _cut(shared.down_proj.weight, ShardSpec(1), tp)
                shared.intermediate_size //= size
                mark(mlp.shared_expert_gate.weight, sequence_parallel=True)
            mlp.register_forward_hook(_OutOfRow(tp))
        else:
            mlp.gate_proj = ColumnParallelLinear(mlp.gate_proj, tp, entered=True)
            mlp.up_proj = ColumnParallelLinear(mlp.up_proj, tp, entered=True)
            mlp.down_proj = RowParallelLinear(mlp.down_proj, tp)
            if hasattr(mlp, "intermediate_size"):
                mlp.intermediate_size //= size
    for norm in norms:
        norm.register_forward_hook(_IntoColumn(tp))
        _sequence_parallel(norm, tp)
    for m in block.modules():
        if getattr(m, "config", None) is layer.config:
            m.config = local
    layer.config = local
    layer.tp = tp
    return layer
