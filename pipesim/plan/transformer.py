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
* for GQA, SwiGLU and MoE shapes the same counts generalised (:mod:`pipesim.plan.flops`,
  :mod:`pipesim.plan.footprint`); a full training configuration is a :class:`pipesim.Plan`;
* the embedding on the first stage (dropout mask ``sbh`` bytes), the final norm and LM head on
  the last (``2 b s h V`` FLOPs forward, each backward half the same, logits kept in fp32:
  ``4 s b V`` bytes, Korthikanti et al. §4.3);
* mixed-precision Adam: 16 bytes per parameter held for the whole step (bf16 weight and
  gradient, fp32 master weight and two moments; Rajbhandari et al. 2020, ZeRO §3), gradients
  all-reduced in bf16 (2 bytes per parameter), and an optimizer step bound by HBM bandwidth
  (28 bytes read and written per parameter).
"""
from __future__ import annotations

from dataclasses import dataclass

from .model import ModelSpec
from .partition import even_split


def split_layers(layers: int, num_stages: int) -> list[int]:
    """Layers per stage, as even as possible (`pipesim.plan.partition.even_split`: the first
    ``layers % num_stages`` stages get one more)."""
    if layers < num_stages:
        raise ValueError(f"model has {layers} layers, fewer than num_stages = {num_stages}")
    return even_split(layers, num_stages)


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
    from .flops import layer_flops
    from .footprint import layer_activations
    from .parallelism import Parallelism

    b, s, h, v = micro_batch_size, model.seq_length, model.hidden, model.vocab
    sbh = s * b * h
    unfused = Parallelism(micro_batch_size=b, flash_attention=False)
    kinds = {}
    for moe in set(model.moe_pattern()):
        lf = layer_flops(model, b, moe=moe)
        la = layer_activations(model, unfused, moe)
        kinds[moe] = (lf.forward, lf.input_grad, lf.weight_grad, la.total, la.weight_grad,
                      sum(model.layer_params(moe).values()))
    pattern = model.moe_pattern()
    head = 2 * b * s * h * v
    counts = split_layers(model.layers, num_stages)
    f, i, w, act, wact, params = [], [], [], [], [], []
    last = num_stages - 1
    start = 0
    pos = (s if model.position == "learned" else 0) * h
    for stage, n in enumerate(counts):
        sums = [sum(kinds[moe][k] for moe in pattern[start:start + n]) for k in range(6)]
        start += n
        f.append(sums[0] + (head if stage == last else 0))
        i.append(sums[1] + (head if stage == last else 0))
        w.append(sums[2] + (head if stage == last else 0))
        act.append(sums[3] + (sbh if stage == 0 else 0)
                   + (2 * sbh + 4 * s * b * v if stage == last else 0))
        wact.append(sums[4] + (2 * sbh if stage == last else 0))
        params.append(sums[5] + (v * h + pos if stage == 0 else 0)
                      + (v * h + model.norm_params() if stage == last else 0))
    return StageCounts(f, i, w, act, wact, dtype_bytes * sbh, params)
