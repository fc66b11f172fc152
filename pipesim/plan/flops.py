"""FLOPs of one layer, of the head, and of a training step, split F / I / W.

Counts are those of matrix multiplies (2 FLOPs per multiply-add), as Megatron-LM's
``num_floating_point_operations`` (megatron/training/training.py) and Narayanan et al. 2021
(eq. 3) count them; element-wise work, softmax, norms and the MoE router are not counted.
Attention over the full ``s x s`` scores by default, as Korthikanti et al. 2022 (eq. 7) count
it; ``causal=True`` halves the score and value matmuls, as current Megatron-LM counts them
(and as causal flash-attention kernels compute them, skipping the masked blocks).

A layer's forward is ``G + A``: ``G`` the GEMMs with weights (QKV with GQA, output projection,
two or three MLP matrices, top-k experts plus a shared expert), ``A = 4 b s^2 q`` the score and
value matmuls (``q = heads * head_dim``). The backward splits as in the Zero Bubble paper (Qi
et al. 2024, §2): the input gradient I costs ``G + 2A`` (every GEMM once, the attention matmuls
twice), the weight gradient W costs ``G`` (only GEMMs with weights have one). For GPT shapes
this is the paper's Table 1: F ``sbh(24h + 4s)``, I ``sbh(24h + 8s)``, W ``24 sbh^2``.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .model import ModelSpec


@dataclass(frozen=True)
class LayerFlops:
    """Forward FLOPs of one layer for ``b`` sequences: GEMMs with weights and attention matmuls."""

    gemm: float
    attention: float

    @property
    def forward(self) -> float:
        return self.gemm + self.attention

    @property
    def input_grad(self) -> float:
        return self.gemm + 2 * self.attention

    @property
    def weight_grad(self) -> float:
        return self.gemm


def layer_flops(model: ModelSpec, b: int, s: int | None = None, moe: bool = False,
                causal: bool = False) -> LayerFlops:
    return _layer_flops(model, b, model.seq_length if s is None else s, bool(moe), bool(causal))


# The counts are pure functions of immutable values, asked for every layer of every plan a
# search derives (the same few shapes each time): each is computed once per distinct argument.
@lru_cache(maxsize=1024)
def _layer_flops(model: ModelSpec, b: int, s: int, moe: bool, causal: bool) -> LayerFlops:
    tokens = b * s
    h = model.hidden
    attn_gemm = 2 * tokens * sum(i * o for _, i, o in model.attention_weight_shapes())
    if moe:
        mlp = (model.top_k * 2 * tokens * h * model.moe_ffn * model.mlp_matrices
               + 2 * tokens * h * model.shared_expert_ffn_hidden * model.mlp_matrices)
    else:
        mlp = 2 * tokens * h * model.ffn * model.mlp_matrices
    # MLA: scores over the q/k head dim, values over the value head dim (attention_width);
    # sliding-window layers: their span (attention_span, the layers' mean)
    attention = 4 * b * s * model.attention_span(s) * model.attention_width / (2 if causal else 1)
    return LayerFlops(gemm=float(attn_gemm + mlp), attention=float(attention))


def head_flops(model: ModelSpec, b: int, s: int | None = None, tp: int = 1) -> float:
    """Forward FLOPs of the output layer (padded vocabulary); I and W cost the same each."""
    s = model.seq_length if s is None else s
    return float(2 * b * s * model.hidden * model.padded_vocab(tp))


@lru_cache(maxsize=1024)
def model_flops(model: ModelSpec, batch: int, tp: int = 1, causal: bool = False) -> float:
    """FLOPs of forward and backward (3x forward) for ``batch`` sequences: Korthikanti et al.
    2022 eq. 7's "model FLOPs", generalised; no recomputation."""
    fwd = sum(layer_flops(model, batch, moe=moe, causal=causal).forward
              for moe in model.moe_pattern())
    return 3 * (fwd + head_flops(model, batch, tp=tp) + model.mtp_layers * mtp_flops(
        model, batch, tp=tp, causal=causal))


def mtp_flops(model: ModelSpec, b: int, tp: int = 1, causal: bool = False) -> float:
    """Forward FLOPs of one multi-token-prediction module (DeepSeek-V3): its projection
    ``2 b s (2h) h``, its MoE layer and its pass through the output layer."""
    s = model.seq_length
    layer = layer_flops(model, b, moe=model.is_moe, causal=causal).forward
    return float(2 * b * s * 2 * model.hidden * model.hidden + layer + head_flops(model, b, tp=tp))


@lru_cache(maxsize=1024)
def recompute_flops(model: ModelSpec, batch: int, recompute: str, layers: int | None = None,
                    flash: bool = False, causal: bool = False) -> float:
    """Extra FLOPs recomputation adds for ``batch`` sequences: a full forward of each of the
    ``layers`` recomputed layers (default all), or the attention matmuls (selective; none with
    flash attention, which keeps no scores to drop)."""
    pattern = model.moe_pattern()
    if recompute == "full":
        chosen = pattern if layers is None else pattern[:layers]
        return sum(layer_flops(model, batch, moe=moe, causal=causal).forward for moe in chosen)
    if recompute == "selective" and not flash:
        return sum(layer_flops(model, batch, moe=moe, causal=causal).attention for moe in pattern)
    return 0.0
