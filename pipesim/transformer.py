"""Per-stage time and bytes of a GPT-style decoder cut into pipeline stages.

Closed-form counts, so a user can predict a schedule on a cluster they do not have:

* forward FLOPs of one layer, ``24 b s h^2 (1 + s / 6h)`` (Narayanan et al. 2021, "Efficient
  Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", eq. 2 without the
  factor 3 for the backward pass);
* the backward pass split as in the Zero Bubble paper (Qi et al. 2024, Table 1): forward
  ``sbh(24h + 4s)``, input gradient I ``sbh(24h + 8s)``, weight gradient W ``sbh * 24h``;
* activation bytes of one layer ``sbh(34 + 5as/h)`` (Korthikanti et al. 2022, "Reducing
  Activation Recomputation in Large Transformer Models", eq. 1, no tensor parallelism). The
  weight gradient needs the inputs of the four linear layers, ``2+2+2+8 = 14 sbh`` of those
  bytes (same paper's breakdown); I frees the rest;
* the embedding on the first stage (dropout mask ``sbh`` bytes), the final norm and LM head on
  the last (``2 b s h V`` FLOPs forward, each backward half the same, logits kept in fp32:
  ``4 s b V`` bytes, Korthikanti et al. §4.3);
* mixed-precision Adam: 16 bytes per parameter held for the whole step (bf16 weight and
  gradient, fp32 master weight and two moments; Rajbhandari et al. 2020, ZeRO §3), gradients
  all-reduced in bf16 (2 bytes per parameter), and an optimizer step bound by HBM bandwidth
  (28 bytes read and written per parameter).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer: ``layers`` blocks of width ``hidden`` with ``heads`` heads."""

    name: str
    layers: int
    hidden: int
    heads: int
    seq_length: int
    vocab: int

    def to_dict(self) -> dict:
        return asdict(self)


_MODELS = {
    "tiny": ModelSpec("tiny", 8, 512, 8, 512, 32000),
    "gpt3-1.3b": ModelSpec("gpt3-1.3b", 24, 2048, 16, 2048, 50257),
    "gpt3-2.7b": ModelSpec("gpt3-2.7b", 32, 2560, 32, 2048, 50257),
    "gpt3-6.7b": ModelSpec("gpt3-6.7b", 32, 4096, 32, 2048, 50257),
    "gpt3-13b": ModelSpec("gpt3-13b", 40, 5120, 40, 2048, 50257),
    "gpt3-175b": ModelSpec("gpt3-175b", 96, 12288, 96, 2048, 50257),
}


def model_names() -> list[str]:
    return list(_MODELS)


def get_model(name: "str | ModelSpec") -> ModelSpec:
    if isinstance(name, ModelSpec):
        return name
    spec = _MODELS.get(str(name).lower())
    if spec is None:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(_MODELS)}")
    return spec


def split_layers(layers: int, num_stages: int) -> list[int]:
    """Layers per stage, as even as possible; the first ``layers % num_stages`` stages get one more."""
    if layers < num_stages:
        raise ValueError(f"model has {layers} layers, fewer than num_stages = {num_stages}")
    base, extra = divmod(layers, num_stages)
    return [base + (1 if s < extra else 0) for s in range(num_stages)]


@dataclass(frozen=True)
class StageCounts:
    """Per-stage FLOPs and bytes (lists of length num_stages), before any hardware is applied."""

    forward_flops: list[float]
    input_grad_flops: list[float]
    weight_grad_flops: list[float]
    activation_bytes: list[float]
    weight_grad_bytes: list[float]     # part of activation_bytes still held after I, freed by W
    boundary_bytes: float              # one activation (or its gradient) crossing a stage boundary
    params: list[float]


def stage_counts(model: ModelSpec, num_stages: int, micro_batch_size: int = 1,
                 dtype_bytes: int = 2) -> StageCounts:
    """FLOPs and bytes of each stage for one microbatch of ``micro_batch_size`` sequences."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    b, s, h, a, v = micro_batch_size, model.seq_length, model.hidden, model.heads, model.vocab
    sbh = s * b * h
    layer_f = sbh * (24 * h + 4 * s)
    layer_i = sbh * (24 * h + 8 * s)
    layer_w = sbh * 24 * h
    layer_act = sbh * (34 + 5 * a * s / h)
    layer_wact = 14 * sbh
    layer_params = 12 * h * h + 13 * h
    head = 2 * b * s * h * v
    counts = split_layers(model.layers, num_stages)
    f, i, w, act, wact, params = [], [], [], [], [], []
    last = num_stages - 1
    for stage, n in enumerate(counts):
        f.append(n * layer_f + (head if stage == last else 0))
        i.append(n * layer_i + (head if stage == last else 0))
        w.append(n * layer_w + (head if stage == last else 0))
        act.append(n * layer_act + (sbh if stage == 0 else 0)
                   + (2 * sbh + 4 * s * b * v if stage == last else 0))
        wact.append(n * layer_wact + (2 * sbh if stage == last else 0))
        params.append(n * layer_params + ((v + s) * h if stage == 0 else 0)
                      + (v * h + 2 * h if stage == last else 0))
    return StageCounts(f, i, w, act, wact, dtype_bytes * sbh, params)
