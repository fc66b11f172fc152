"""What a Hugging Face family's transformers modules save for the backward beyond the formulas.

`pipesim.plan.footprint` counts a layer's activations as Megatron-LM's fused kernels keep them
(Korthikanti et al.): a norm keeps its input, a SwiGLU its fc1 output and gated product, a MoE
layer each routed copy's MLP activations. transformers' modules are plain PyTorch, and autograd
saves what each operator's backward reads. Read off the autograd graph of one decoder layer
(transformers 5.24, Llama and Mixtral on CPU: every saved tensor's storage, parameters left out),
per microbatch of ``b`` sequences of ``s`` tokens, beyond the formulas:

* each RMSNorm (``x * rsqrt(mean(x^2) + eps)`` in fp32, times the weight in the input's type):
  the normalised input and the fp32 1/rms, ``4 sbh + 4 sb`` bytes whatever the precision (in
  16-bit it keeps the fp32 copy of its input instead of the input itself): two per layer, the
  head's final norm, and Qwen3's q/k norms on the heads' q and k;
* rotary: the ``cos`` and ``sin`` tables (``s x head_dim``, the activations' type) the q and k
  products keep, one pair per layer (a layer computes its own);
* SwiGLU (``act(gate) * up``): the activation's output, ``e sbf`` (each routed copy's for MoE,
  and the shared expert's);
* MoE: each copy's expert output kept for the routing-weight product (``k e sbh``) and the
  weights (``k e sb``), the router's fp32 softmax (``4 sbE``), its int64 top-k indices
  (``8 sbk``) and the renormalisation's operands (``4 sb(k + 1)``).

GPT-2's LayerNorm and GeLU keep what the formulas count. A layer under full recomputation keeps
only its input (no extra); selective recomputation leaves these outside the core attention.
Measured against the held-tensor meter by tests/exec/test_hf_plan_memory.py.
"""
from __future__ import annotations

from typing import Any

from pipesim.plan.footprint import activation_element_bytes


def layer_extra(model: Any, par: Any, moe: bool) -> float:
    """Bytes one decoder layer of ``model``'s Hugging Face family saves beyond
    `pipesim.plan.footprint.layer_activations`, for one microbatch on one rank."""
    b, s = par.micro_batch_size, model.seq_length / par.cp
    t, sp = par.tp, par.sp
    e = activation_element_bytes(par)
    h = model.hidden
    extra = 0.0
    if model.norm == "rmsnorm":
        extra += 2 * (4 * s * b * h / sp + 4 * s * b / sp)
        if getattr(model, "qk_norm", False):
            width = (model.q_size + model.kv_size) / t
            extra += 4 * s * b * width + 4 * s * b * width / model.kv_channels
    if model.position == "rotary":
        extra += 2 * e * s * model.kv_channels
    if moe:
        k = model.top_k
        if model.gated:
            extra += e * s * b * (k * model.moe_ffn + model.shared_expert_ffn_hidden) / t
        extra += k * e * s * b * h + k * e * s * b
        extra += 4 * s * b * model.experts + 8 * s * b * k + 4 * s * b * (k + 1)
    elif model.gated:
        extra += e * s * b * model.ffn / t
    return extra


def stage_extras(plan: Any) -> list[float]:
    """Per stage of ``plan`` (as `pipesim.Plan.stage_layers` cuts it), the bytes its decoder
    layers (and on the last, the head's norm) save beyond the formulas for one microbatch
    (none for a layer recomputed in full)."""
    model, par = plan.model, plan.parallelism
    pattern = model.moe_pattern()
    out, start = [], 0
    for count in plan.stage_layers():
        total = 0.0
        for j, moe in enumerate(pattern[start:start + count]):
            full = par.recompute == "full" and (par.recompute_layers is None
                                                 or j < par.recompute_layers)
            if not full:
                total += layer_extra(model, par, moe)
        out.append(total)
        start += count
    if out:
        out[-1] += head_extra(model, par)
    return out


def head_extra(model: Any, par: Any) -> float:
    """Bytes the head's final norm saves beyond the formulas (an RMSNorm's, as a layer's)."""
    if model.norm != "rmsnorm":
        return 0.0
    b, s = par.micro_batch_size, model.seq_length / par.cp
    return (4 * s * b * model.hidden + 4 * s * b) / par.sp
