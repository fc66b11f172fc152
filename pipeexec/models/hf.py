"""Hugging Face causal LMs as pipeline layer lists (needs ``transformers``: the ``hf`` extra).

`hf_layer_stack(model, weights=DIR)` turns a plan's model of a Hugging Face family (a
`pipesim.ModelSpec` with ``family`` and ``hf_config``: `hf_config.config_for` is the config it
spells) into a `LayerStack` of ``num_hidden_layers + 2`` layers, built from the family's own
transformers modules so the arithmetic is Hugging Face's (`hf_dir_stack(DIR)`: a model
directory's, ``config.json`` and optionally ``*.safetensors``):

* layer 0, `HFEmbedding`: token embedding (GPT-2: plus learned positions and dropout);
* layers 1..L, `HFDecoderLayer`: one decoder layer (``LlamaDecoderLayer``, ``GPT2Block``...).
  Each computes its own position ids, rotary embedding and causal (or sliding-window) mask
  from the hidden state's shape, the way the family's ``*Model.forward`` does, so a stage
  receives and sends the hidden state alone;
* layer L+1, `HFHead`: final norm and LM head.

Weights: loaded from the directory's safetensors when it has any (Hugging Face names, read
tensor by tensor, so a rank reads only its layers), else initialised as the family's
``_init_weights`` does (normal(0, ``initializer_range``) matrices, GPT-2's residual
projections scaled by 1/sqrt(2 n_layer), zero biases, unit norms) from the generator seeded by
(seed, layer): the same weights whatever the layout. Tied embeddings (GPT-2's default,
``tie_word_embeddings``) are declared in `LayerStack.tied`: the head's weight starts as the
embedding's and stays one parameter with it. `hf_reference_model` gives the unsplit
``AutoModelForCausalLM`` the very same weights; `hf_name` maps a pipeexec parameter name
(``layers.<i>.<name>``) to the Hugging Face one.

Tensor parallelism (``tp``): each layer is built whole (initialised or loaded: the full tensors)
and then cut by `hf_tensor_parallel`; the loss is then vocab-parallel. Under sequence
parallelism the embedding keeps this rank's sequence chunk and a decoder layer makes its
positions and mask for the whole sequence (tp chunks), the length its attention sees.

The routers' load-balancing loss (a MoE config's ``output_router_logits = true``,
`hf_router_loss`): the embedding's output, each decoder layer's input and output and the head's
input are the hidden state with the routers' statistics appended (`RouterLoss.pack`), each MoE
layer adding its router's; the head's output is the logits and ``coef * aux``, which the
stack's loss adds to the LM loss.

Context parallelism (``cp``, `hf_context_parallel`): the embedding reads this cp rank's two
chunks of each sequence, a decoder layer's positions are its tokens' global ones (rotary
follows the chunking) and its attention runs against the keys and values gathered from every
cp rank, with the causal mask at the global positions.
"""
from __future__ import annotations

import copy
import inspect
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..model import LayerStack, lm_loss
from ..parallel import context, regions
from ..parallel.context import ContextParallel
from ..parallel.layers import vocab_parallel_cross_entropy
from ..parallel.regions import NONE, TensorParallel
from .hf_config import (HFModelError, HFModelInfo, config_for, info_from_config, modeling_module,
                        plan_model_of, read_hf_config, weight_files)
from .hf_context_parallel import cp_decoder_layer, cp_embedding
from .hf_router_loss import RouterLoss, router_loss_of, split_head_output
from .hf_tensor_parallel import cut_decoder_layer, cut_embedding, cut_head


def _transformers():
    try:
        import transformers
    except ImportError:
        raise HFModelError("--hf-model needs the transformers package: pip install "
                           "'pipesim[hf]' (or pip install transformers)") from None
    return transformers


@dataclass(frozen=True)
class _Family:
    base: str              # the base model's attribute in *ForCausalLM ("model", "transformer")
    layers: str            # its decoder-layer list ("layers", "h")
    norm: str              # its final norm ("norm", "ln_f")
    decoder: str           # the decoder layer's class in the modeling module
    rotary: str | None     # the rotary embedding's class (None: learned positions)


_LLAMA_LIKE = dict(base="model", layers="layers", norm="norm")
FAMILIES = {
    "llama": _Family(**_LLAMA_LIKE, decoder="LlamaDecoderLayer", rotary="LlamaRotaryEmbedding"),
    "mistral": _Family(**_LLAMA_LIKE, decoder="MistralDecoderLayer",
                       rotary="MistralRotaryEmbedding"),
    "mixtral": _Family(**_LLAMA_LIKE, decoder="MixtralDecoderLayer",
                       rotary="MixtralRotaryEmbedding"),
    "qwen2": _Family(**_LLAMA_LIKE, decoder="Qwen2DecoderLayer", rotary="Qwen2RotaryEmbedding"),
    "qwen2_moe": _Family(**_LLAMA_LIKE, decoder="Qwen2MoeDecoderLayer",
                         rotary="Qwen2MoeRotaryEmbedding"),
    "qwen3_moe": _Family(**_LLAMA_LIKE, decoder="Qwen3MoeDecoderLayer",
                         rotary="Qwen3MoeRotaryEmbedding"),
    "gpt2": _Family(base="transformer", layers="h", norm="ln_f", decoder="GPT2Block",
                    rotary=None),
}


def _modeling(model_type: str):
    import importlib
    _transformers()
    return importlib.import_module(modeling_module(model_type))


def hf_config_object(info: HFModelInfo):
    """The transformers configuration of ``info``, its implementations (attention, experts)
    those ``AutoModelForCausalLM.from_config`` picks."""
    transformers = _transformers()
    values = {k: v for k, v in info.config.items() if k not in ("model_type", "transformers_version",
                                                                 "architectures")}
    config = transformers.AutoConfig.for_model(info.model_type, **values)
    # Building the model (on the meta device: no memory, no init) settles the attention and
    # experts implementations on the config as the unsplit model has them.
    with torch.device("meta"):
        transformers.AutoModelForCausalLM.from_config(config)
    return config


def _mask_kind(config, j: int) -> str:
    """Decoder layer ``j``'s attention: "full_attention" or "sliding_attention", as the
    family's model picks its mask (``layer_types`` when the config has them, else Mistral's
    rule: sliding when ``sliding_window`` is set)."""
    types = getattr(config, "layer_types", None)
    if types:
        return types[j]
    return "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"


def _selective_attention(model_type: str, base: str) -> str:
    """The name of an attention implementation that runs ``base`` (the family's ``eager``
    function, or a registered one such as ``sdpa``) under torch.utils.checkpoint, registered
    through transformers' public extension point (`AttentionInterface.register`) on first use."""
    transformers = _transformers()
    name = f"pipeexec-selective-{model_type}-{base}"
    interface = transformers.AttentionInterface
    known = interface()
    if name not in known.valid_keys():
        base_fn = (_modeling(model_type).eager_attention_forward if base == "eager"
                   else known[base])

        def checkpointed(module, query, key, value, attention_mask, **kwargs):
            if not torch.is_grad_enabled():
                return base_fn(module, query, key, value, attention_mask, **kwargs)
            return checkpoint(lambda q, k, v: base_fn(module, q, k, v, attention_mask, **kwargs),
                              query, key, value, use_reentrant=False)

        interface.register(name, checkpointed)
    return name


# -- the layers -----------------------------------------------------------------------------
class HFEmbedding(nn.Module):
    """Token ids (batch, seq) -> hidden (batch, seq, hidden). GPT-2: + learned positions,
    then embedding dropout. Sequence parallel: this rank's chunk of the sequence."""

    tp: TensorParallel = NONE      # set by `hf_tensor_parallel.cut_embedding`
    cp: ContextParallel = context.NONE     # set by `hf_context_parallel.cp_embedding`
    router: RouterLoss | None = None       # the routers' aux loss: starts the statistics

    def __init__(self, config, model_type: str) -> None:
        super().__init__()
        self.gpt2 = model_type == "gpt2"
        hidden = config.hidden_size
        if self.gpt2:
            self.wte = nn.Embedding(config.vocab_size, hidden)
            self.wpe = nn.Embedding(config.max_position_embeddings, hidden)
            self.drop = nn.Dropout(config.embd_pdrop)
        else:
            self.embed_tokens = nn.Embedding(config.vocab_size, hidden, config.pad_token_id)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if not self.gpt2:
            x = self.embed_tokens(tokens)
        else:
            positions = (context.local_positions(tokens.shape[1], self.cp, tokens.device)
                         if self.cp.active else torch.arange(tokens.shape[1], device=tokens.device))
            x = self.drop(self.wte(tokens) + self.wpe(positions.unsqueeze(0)))
        if self.tp.sequence_parallel:
            x = regions.scatter_sequence(x, self.tp)
        return x if self.router is None else self.router.start(x)


def cache_keyword(make_mask: Any) -> str:
    """The name of the masks' cache argument: ``cache`` in transformers 5.2x,
    ``past_key_values`` before (5.0-5.1x; later releases keep it as a keyword alias)."""
    params = inspect.signature(make_mask).parameters
    return "cache" if "cache" in params else "past_key_values"


class HFDecoderLayer(nn.Module):
    """One Hugging Face decoder layer (``block``) that makes its own position ids, rotary
    embedding and causal mask from its input: hidden -> hidden. Sequence parallel: the input
    is one of tp chunks, the positions and mask the whole sequence's (the attention's input
    is gathered)."""

    tp: TensorParallel = NONE      # set by `hf_tensor_parallel.cut_decoder_layer`
    cp: ContextParallel = context.NONE     # set by `hf_context_parallel.cp_decoder_layer`
    router: RouterLoss | None = None       # set by `carry_router_loss`
    _cp_selective = False
    routed_logits: list | None = None

    def __init__(self, config, model_type: str, j: int) -> None:
        super().__init__()
        family, modeling = FAMILIES[model_type], _modeling(model_type)
        self.config = config
        self.model_type = model_type
        self.block = getattr(modeling, family.decoder)(config, layer_idx=j)
        self.rotary = None if family.rotary is None else getattr(modeling, family.rotary)(config=config)
        self.sliding = _mask_kind(config, j) == "sliding_attention"

    @property
    def recompute_core_attention(self) -> bool:
        """Selective recomputation (`Stage.set_recompute`): the attention module's core
        attention (softmax(QK^T)V, its mask and dropout) runs under torch.utils.checkpoint.
        Under context parallelism the attention recomputes its core in the backward anyway:
        the switch is kept and changes nothing."""
        if self.cp.active:
            return self._cp_selective
        return self.attention_module().config is not self.config

    @recompute_core_attention.setter
    def recompute_core_attention(self, on: bool) -> None:
        if self.cp.active:
            self._cp_selective = bool(on)
            return
        attention = self.attention_module()
        if not on:
            attention.config = self.config
        elif attention.config is self.config:
            # the attention module alone reads a copy naming the checkpointed implementation;
            # the layer's masks keep the base implementation's format
            local = copy.copy(self.config)
            local._attn_implementation = _selective_attention(self.model_type,
                                                              self.config._attn_implementation)
            attention.config = local

    def router_module(self) -> nn.Module | None:
        """The block's router (``mlp.gate``, a ``*TopKRouter``), or None: a dense layer."""
        gate = getattr(getattr(self.block, "mlp", None), "gate", None)
        return gate if type(gate).__name__.endswith("TopKRouter") else None

    def carry_router_loss(self, router: RouterLoss) -> None:
        """Take and give the packed activation of `hf_router_loss`, adding this layer's
        router statistics (its logits recorded by a forward hook on the router, as Hugging
        Face's ``OutputRecorder(*TopKRouter, index=0)`` records them)."""
        self.router = router
        gate = self.router_module()
        if gate is not None:
            gate.register_forward_hook(_RecordLogits(self))

    def attention_module(self) -> nn.Module:
        """The attention module of ``block`` (GPT-2: ``attn``, else ``self_attn``)."""
        return self.block.attn if self.model_type == "gpt2" else self.block.self_attn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.router is None:
            return self._forward(x)
        x, side = self.router.unpack(x)
        self.routed_logits = routed = []
        try:
            out = self._forward(x)
        finally:
            self.routed_logits = None
        for logits in routed:
            side = self.router.add_layer(side, logits)
        return self.router.pack(out, side)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        seq = x.shape[1] * (self.tp.size if self.tp.sequence_parallel else 1)
        if self.cp.active:
            # this cp rank's tokens at their global positions; the context-parallel attention
            # makes the mask for them against the whole sequence
            positions = context.local_positions(seq, self.cp, x.device).unsqueeze(0)
            mask = None
        else:
            positions = torch.arange(seq, device=x.device).unsqueeze(0)
            whole = x if seq == x.shape[1] else x[:, :1].expand(x.shape[0], seq, x.shape[2])
            make_mask = create_sliding_window_causal_mask if self.sliding else create_causal_mask
            mask = make_mask(config=self.config, inputs_embeds=whole, attention_mask=None,
                             position_ids=positions, **{cache_keyword(make_mask): None})
        if self.rotary is None:
            out = self.block(x, attention_mask=mask, position_ids=positions)
        else:
            out = self.block(x, attention_mask=mask, position_ids=positions,
                             position_embeddings=self.rotary(x, position_ids=positions))
        return out[0] if isinstance(out, tuple) else out


class _RecordLogits:
    """Forward hook on a router: its logits (output 0) into the layer's list of the call."""

    def __init__(self, layer: HFDecoderLayer) -> None:
        self.layer = layer

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.layer.routed_logits is not None:
            self.layer.routed_logits.append(output[0])


class HFHead(nn.Module):
    """Final norm and LM head: hidden -> logits (batch, seq, vocab). With the routers' aux
    loss: packed -> [logits (fp32), coef * aux] (`RouterLoss.head_output`)."""

    router: RouterLoss | None = None

    def __init__(self, config, model_type: str) -> None:
        super().__init__()
        norm_name = FAMILIES[model_type].norm
        if model_type == "gpt2":
            norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        else:
            norm = getattr(_modeling(model_type), FAMILIES[model_type].decoder.replace(
                "DecoderLayer", "RMSNorm"))(config.hidden_size, eps=config.rms_norm_eps)
        self.norm_name = norm_name
        setattr(self, norm_name, norm)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.router is None:
            return self.lm_head(getattr(self, self.norm_name)(x))
        x, side = self.router.unpack(x)
        return self.router.head_output(self.lm_head(getattr(self, self.norm_name)(x)), side)


# -- names and weights ----------------------------------------------------------------------
def hf_name(model_type: str, num_blocks: int, name: str) -> str:
    """The Hugging Face parameter name of pipeexec's ``layers.<i>.<name>``."""
    family = FAMILIES[model_type]
    _, index, local = name.split(".", 2)
    i = int(index)
    if i == 0:
        return f"{family.base}.{local}"
    if i == num_blocks + 1:
        return local if local.startswith("lm_head.") else f"{family.base}.{local}"
    return f"{family.base}.{family.layers}.{i - 1}.{local.removeprefix('block.')}"


def _init(layer: nn.Module, config, model_type: str, gen: torch.Generator) -> None:
    """The family's ``_init_weights``, drawn from ``gen`` in parameter order."""
    std = config.initializer_range
    residual_std = std / math.sqrt(2 * config.num_hidden_layers)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)                     # norm weights
            else:
                scale = residual_std if (model_type == "gpt2" and name.endswith("c_proj.weight")) else std
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
        for m in layer.modules():
            if isinstance(m, nn.Embedding) and m.padding_idx is not None:
                m.weight[m.padding_idx].zero_()


class _Checkpoint:
    """Tensors of a directory's safetensors files by Hugging Face name, read one at a time."""

    def __init__(self, files: tuple[str, ...]) -> None:
        from safetensors import safe_open

        self.where: dict[str, str] = {}
        for f in files:
            with safe_open(f, "pt") as handle:
                for key in handle.keys():
                    self.where[key] = f

    def has(self, key: str) -> bool:
        return key in self.where

    def get(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self.where[key], "pt") as handle:
            return handle.get_tensor(key)


def _find(ckpt: _Checkpoint, key: str, model_type: str) -> torch.Tensor | None:
    if ckpt.has(key):
        return ckpt.get(key)
    base = FAMILIES[model_type].base + "."
    if key.startswith(base) and ckpt.has(key[len(base):]):     # GPT-2 files without the prefix
        return ckpt.get(key[len(base):])
    if model_type in ("qwen2_moe", "qwen3_moe") and key.endswith(
            (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
        experts, e = [], 0                                      # per-expert layout on disk
        prefix = key.rsplit(".", 1)[0]
        while ckpt.has(f"{prefix}.{e}.down_proj.weight"):
            w = f"{prefix}.{e}"
            experts.append(torch.cat([ckpt.get(f"{w}.gate_proj.weight"),
                                      ckpt.get(f"{w}.up_proj.weight")])
                           if key.endswith("gate_up_proj") else ckpt.get(f"{w}.down_proj.weight"))
            e += 1
        return torch.stack(experts) if experts else None
    if model_type == "mixtral" and ".mlp." in key:             # per-expert layout on disk
        prefix, rest = key.split(".mlp.", 1)
        moe = f"{prefix}.block_sparse_moe"
        if rest == "gate.weight" and ckpt.has(f"{moe}.gate.weight"):
            return ckpt.get(f"{moe}.gate.weight")
        if rest in ("experts.gate_up_proj", "experts.down_proj"):
            experts, e = [], 0
            while ckpt.has(f"{moe}.experts.{e}.w1.weight"):
                w = f"{moe}.experts.{e}"
                experts.append(torch.cat([ckpt.get(f"{w}.w1.weight"), ckpt.get(f"{w}.w3.weight")])
                               if rest == "experts.gate_up_proj" else ckpt.get(f"{w}.w2.weight"))
                e += 1
            if experts:
                return torch.stack(experts)
    return None


def _load(layer: nn.Module, index: int, info: HFModelInfo, ckpt: _Checkpoint) -> None:
    with torch.no_grad():
        for name, p in layer.named_parameters():
            key = hf_name(info.model_type, info.layers, f"layers.{index}.{name}")
            t = _find(ckpt, key, info.model_type)
            if t is None and key == "lm_head.weight" and info.tied_embeddings:
                t = _find(ckpt, hf_name(info.model_type, info.layers, "layers.0." + (
                    "wte.weight" if info.model_type == "gpt2" else "embed_tokens.weight")),
                    info.model_type)
            if t is None:
                raise HFModelError(f"{info.path}: the safetensors files hold no {key!r} "
                                   f"(pipeexec's layers.{index}.{name}); save the checkpoint "
                                   "with this transformers version's save_pretrained")
            if tuple(t.shape) != tuple(p.shape):
                raise HFModelError(f"{info.path}: {key} has shape {tuple(t.shape)}, the model "
                                   f"built from config.json {tuple(p.shape)}")
            p.copy_(t.to(p.dtype))


# -- the stack ------------------------------------------------------------------------------
def hf_layer_stack(model: Any, *, weights: str | Path | None = None,
                   tp: TensorParallel = NONE, cp: ContextParallel = context.NONE) -> LayerStack:
    """The `LayerStack` of ``model`` (a plan's `pipesim.ModelSpec` of a Hugging Face family):
    [embedding, decoder layer x L, norm + head], next-token cross-entropy, built from the
    config the spec spells. Weights from the safetensors of the directory ``weights`` when it
    has any, else the deterministic initialisation. ``tp``: this rank's tensor-parallel
    group; each layer is built whole and cut (`hf_tensor_parallel`), the loss vocab-parallel.
    ``cp``: its context-parallel group (`hf_context_parallel`)."""
    files = () if weights is None else weight_files(weights)
    info = info_from_config(config_for(model), str(weights or "the plan's model"), files)
    return _stack(info, tp, cp)


def hf_dir_stack(path: str | Path, *, seq_length: int | None = None,
                 load_weights: bool = True) -> LayerStack:
    """The `LayerStack` of the Hugging Face model directory ``path`` (its config.json the
    model, as `plan_model_of` reads it; its safetensors the weights when ``load_weights``)."""
    info = read_hf_config(path)
    model = plan_model_of(path, seq_length=seq_length or 1)
    return hf_layer_stack(model, weights=path if load_weights and info.checkpoint_files else None)


def _stack(info: HFModelInfo, tp: TensorParallel = NONE,
           cp: ContextParallel = context.NONE) -> LayerStack:
    if info.model_type not in FAMILIES:
        raise HFModelError(f"{info.path}: model_type {info.model_type!r} is not supported")
    config = hf_config_object(info)
    n, kind = info.layers, info.model_type
    ckpt = _Checkpoint(info.checkpoint_files) if info.checkpoint_files else None
    router = router_loss_of(config, tp, cp)

    def factory(index: int, gen: torch.Generator) -> nn.Module:
        if index == 0:
            layer = HFEmbedding(config, kind)
        elif index == n + 1:
            layer = HFHead(config, kind)
        else:
            layer = HFDecoderLayer(config, kind, index - 1)
        if ckpt is not None:
            _load(layer, index, info, ckpt)
        else:
            _init(layer, config, kind, gen)
        if tp.active:
            if index == 0:
                layer = cut_embedding(layer, kind, tp)
            elif index == n + 1:
                layer = cut_head(layer, tp)
            else:
                layer = cut_decoder_layer(layer, kind, tp)
        if cp.active and index == 0:
            layer = cp_embedding(layer, cp)
        elif cp.active and index != n + 1:
            layer = cp_decoder_layer(layer, kind, cp, _modeling(kind).eager_attention_forward)
        if router is not None:
            if index in (0, n + 1):
                layer.router = router
            else:
                layer.carry_router_loss(router)
        return layer

    # a tied head is the embedding: one parameter across the first and last stage
    # (pipeexec.training.tied keeps the instances equal and sums their gradients)
    embedding = "wte.weight" if kind == "gpt2" else "embed_tokens.weight"
    tied = (((f"layers.{n + 1}.lm_head.weight", f"layers.0.{embedding}"),)
            if info.tied_embeddings else ())
    kinds = ("embedding",) + tuple(
        "block" if _mask_kind(config, j) == "full_attention" else "sliding-block"
        for j in range(n)) + ("head",)
    counts = _param_counts(config, kind, n)
    loss = lm_loss if not tp.active else (
        lambda logits, targets: vocab_parallel_cross_entropy(logits, targets, config.vocab_size,
                                                             tp))
    if router is not None:
        loss = _with_router_loss(loss)
    return LayerStack(n + 2, factory, loss, counts, kinds, tied=tied, blocks=n)


def _with_router_loss(lm: Any) -> Any:
    """The loss of a head that carries ``coef * aux``: the LM loss plus it (Hugging Face's
    ``loss += router_aux_loss_coef * aux_loss``)."""
    def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits, term = split_head_output(output, targets)
        return lm(logits, targets) + term
    return loss


def _param_counts(config, kind: str, n: int) -> tuple[int, ...]:
    """Per layer, from modules built on the meta device (no memory, no init)."""
    with torch.device("meta"):
        first = sum(p.numel() for p in HFEmbedding(config, kind).parameters())
        blocks = tuple(sum(p.numel() for p in HFDecoderLayer(config, kind, j).parameters())
                       for j in range(n))
        last = sum(p.numel() for p in HFHead(config, kind).parameters())
    return (first,) + blocks + (last,)


def hf_reference_model(path: str | Path, seed: int) -> Any:
    """The unsplit ``AutoModelForCausalLM`` of ``path`` holding exactly the weights
    `hf_dir_stack(path)` gives its layers for ``seed`` (for checks against Hugging Face)."""
    transformers = _transformers()
    info = read_hf_config(path)
    spec = hf_dir_stack(path)
    model = transformers.AutoModelForCausalLM.from_config(hf_config_object(info))
    state = {}
    for i in range(spec.num_layers):
        layer = spec.build_layer(i, seed)
        for name, p in layer.named_parameters():
            full = f"layers.{i}.{name}"
            if spec.canonical(full) == full:       # a tied head's weight is the embedding's
                state[hf_name(info.model_type, info.layers, full)] = p.detach()
    missing, unexpected = model.load_state_dict(state, strict=False)
    left = [k for k in missing if not (info.tied_embeddings and k == "lm_head.weight")]
    if left or unexpected:
        raise HFModelError(f"{path}: the layer list and {type(model).__name__} disagree on "
                           f"parameters: missing {left}, unexpected {list(unexpected)}")
    return model

