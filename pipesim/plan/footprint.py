"""Bytes a plan keeps: activations per layer, and weights, gradients and optimizer state.

Activations of one layer for ``b`` sequences, Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", §4, generalised to GQA (query width ``q``,
key/value width ``kv``), SwiGLU (three matrices), MoE and the activation element size ``e``
(`activation_element_bytes`: 2 for bf16 / fp16 / fp8 training, whose activations are 16-bit,
as in the paper; 4 for fp32). With ``e = 2`` every term below is the paper's:

* kept whole on every tensor-parallel rank unless sequence parallelism splits them (``/sp``):
  the two norm inputs ``2e sbh``, the QKV and MLP inputs ``e sbh`` each, the two dropout masks
  ``2sbh`` (one byte each; only with dropout) -- the paper's ``10 sbh``;
* split over tp (``/t``): Q, K, V ``e sb(q + 2kv)``, the output projection's input ``e sbq``,
  the MLP's ``2e sbf`` (GeLU: fc1 output, GeLU output) or ``3e sbf`` (SwiGLU: the ``2f`` fc1
  output and the gated product); an MoE layer stores each token ``k`` times (``e sbh`` routed
  input and the expert's MLP activations per copy) plus its shared expert -- the paper's
  ``24 sbh`` for GPT;
* core attention (``/t``): the softmax output ``e as^2b``, with dropout also its mask
  ``as^2b`` and output ``e as^2b`` -- the paper's ``5as^2b``; with flash attention only the fp32
  log-sum-exp ``4asb`` (FlashAttention saves its output, which is the output projection's
  input already counted); dropped by selective recomputation;
* full recomputation keeps only the layer's input ``e sbh`` (``/sp``).

Low precisions (fp8, mxfp8, nvfp4): the activations stay bf16, but each linear layer keeps the
quantized copy of its input its weight gradient reads (Transformer Engine), ``li`` bytes an
element (`SAVED_INPUT_BYTES`) for the QKV and MLP inputs, the output projection's and fc2's
inputs and the routed copies. Selective recomputation by module (`Parallelism.recompute_modules`,
Megatron's --recompute-modules) drops what each module recomputes: ``layernorm`` the two norm
outputs, ``mla_up_proj`` MLA's Q, K, V, ``mlp`` a dense MLP's insides, ``moe_act`` the routed
experts' activation output, ``moe`` a MoE block's routed copies and experts, ``shared_experts``
the shared expert's; ``core_attn`` the attention core (Megatron's default, ``selective``).

Left out, as in the paper: the norms' per-token statistics (mean and 1/std, ``2sb`` values per
LayerNorm: fp32 on CUDA, the activations' type on CPU; about ``1/(4h)`` of a layer) and the
loss's labels on the last stage (``8sb``).

With context parallelism ``s`` is the local ``s / cp`` (scores: local queries x all keys);
with ``cp_comm = "all_gather"`` the attention keeps only its q, k, v (the backward gathers K/V
again and recomputes the core), so the core term is dropped, as selective recomputation drops
it (the gathered K/V are a transient, `pipesim.plan.derive`). For
GPT shapes in 16-bit this is Table 2 exactly: ``sbh(34 + 5as/h)``; TP ``sbh(10 + 24/t +
5as/(ht))``; TP+SP ``sbh(34/t + 5as/(ht))``; selective ``sbh(10 + 24/t)``; SP+selective
``34 sbh / t``; full ``2sbh``. W (Zero Bubble's weight gradient) needs the inputs of the linear
layers: QKV and fc1 inputs ``e sbh/sp`` each, the output projection's ``e sbq/t`` and fc2's
``e sbf/t`` (GPT, tp=1, 16-bit: ``14 sbh``).

Bytes per parameter, Megatron-LM's distributed optimizer table (docs/source/api-guide/
dist_optimizer.md; ``d`` data-parallel ranks): fp16 params and grads 20 or ``4 + 16/d``; bf16
params with fp32 grads 18 or ``6 + 12/d``; fp32 16 or ``8 + 8/d``. Split as weights / grads /
optimizer: fp16 2/2/16, bf16 (and fp8 GEMMs) 2/4/12, fp32 4/4/8. ZeRO-2 also shards gradients,
ZeRO-3 weights too (plus a transient of two gathered layers).

Gradients in fp32 or in the 16-bit compute dtype (`Parallelism.grad_reduce_in_fp32`): the
table's two 16-bit rows are the two choices. Megatron-LM accumulates and reduces bf16 training's
gradients in fp32 unless told ``--grad-reduce-in-bf16`` (megatron/training/arguments.py), and
fp16's in fp16 unless ``--accumulate-allreduce-grads-in-fp32``; with 16-bit gradients the
optimizer makes an fp32 copy of its shard's gradients for the step (``main_grad``), the 4 bytes
that move from the gradients' column to the optimizer's: 2/2/16, the fp16 row's 20 bytes.
(`bytes_per_param`.)

Gradients sharded or whole through the step (`Parallelism.grads_sharded`): ZeRO-2/3 keep only
their shard when they reduce-scatter once a microbatch (DeepSpeed's stage 2); reducing once a
step (Megatron's distributed optimizer, FSDP under gradient accumulation) accumulates the
microbatches in the whole buffer first, so its gradients cost what ZeRO-1's do.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .model import ModelSpec
from .parallelism import Parallelism

# precision -> (weight, gradient, optimizer) bytes per parameter
BYTES_PER_PARAM = {"fp16": (2, 2, 16), "bf16": (2, 4, 12), "fp8": (2, 4, 12), "mxfp8": (2, 4, 12),
                   "nvfp4": (2, 4, 12), "fp32": (4, 4, 8)}
# precision -> bytes of one activation element (low-precision GEMMs compute in bf16 between
# their linear layers: norms, attention, activation functions, residuals)
ACTIVATION_BYTES = {"fp16": 2, "bf16": 2, "fp8": 2, "mxfp8": 2, "nvfp4": 2, "fp32": 4}
# precision -> bytes a linear layer keeps of its input for the backward, per element: in the
# low precisions Transformer Engine's Linear saves the quantized input, only the column-wise
# copy its weight gradient reads (transformer_engine/pytorch/module/linear.py: the saved
# ``inputmat`` after ``update_usage(rowwise_usage=False)``): fp8 one byte; mxfp8 one byte and
# an E8M0 scale per 32; nvfp4 half a byte and an E4M3 scale per 16. Absent: the activation's
# own element size.
SAVED_INPUT_BYTES = {"fp8": 1.0, "mxfp8": 1.0 + 1 / 32, "nvfp4": 0.5 + 1 / 16}


def bytes_per_param(par: Parallelism) -> tuple[int, int, int]:
    """(weight, gradient, optimizer) bytes per parameter of ``par``'s precision and gradient
    dtype: `BYTES_PER_PARAM`'s row, with 16-bit gradients (2/2/16) or fp32 ones (2/4/12) as
    ``par.grads_fp32`` says."""
    w, g, o = BYTES_PER_PARAM[par.precision]
    if par.precision == "fp32":
        return w, g, o
    return (w, 4, 12) if par.grads_fp32 else (w, 2, 16)


def activation_element_bytes(par: Parallelism) -> int:
    """Bytes of one stored activation value: 4 when training in fp32, else 2."""
    return ACTIVATION_BYTES[par.precision]


@dataclass(frozen=True)
class LayerActivations:
    """Bytes of one layer's activations for one microbatch on one rank, and W's share."""

    total: float
    weight_grad: float


def layer_activations(model: ModelSpec, par: Parallelism, moe: bool = False, *,
                      recompute: str | None = None) -> LayerActivations:
    recompute = par.recompute if recompute is None else recompute
    e = activation_element_bytes(par)
    modules = (tuple(sorted(par.recomputed_modules or ("core_attn",)))
               if recompute == "selective" else ())
    return _layer_activations(model, bool(moe), recompute, par.micro_batch_size, par.cp, par.tp,
                              par.sp, e, par.flash_attention, par.cp_comm,
                              SAVED_INPUT_BYTES.get(par.precision, e), modules)


# A pure function of immutable values that a search asks for every layer of every plan (the
# same few shapes each time): computed once per distinct shape, keyed by what it reads.
@lru_cache(maxsize=4096)
def _layer_activations(model: ModelSpec, moe: bool, recompute: str, b: int, cp: int, t: int,
                       sp: int, e: int, flash_attention: bool, cp_comm: str,
                       li: float, modules: tuple = ()) -> LayerActivations:
    # ``li``: bytes a linear layer's saved input takes an element (`SAVED_INPUT_BYTES`);
    # ``modules``: what selective recomputation runs again (`Parallelism.recomputed_modules`)
    s_full = model.seq_length
    s = s_full / cp
    h, q, kv, a = model.hidden, model.q_size, model.kv_size, model.heads
    drop = 1 if model.dropout else 0
    sbh = s * b * h
    if recompute == "full":
        return LayerActivations(e * sbh / sp, e * sbh / sp)
    # the two norms' inputs (the residual stream) in the activations' type, the QKV and MLP
    # inputs (the norms' outputs) as the linear layers save them ("layernorm": recomputed from
    # the norms' inputs, not kept)
    norm_out = 0.0 if "layernorm" in modules else 2 * li * sbh
    replicated = 2 * e * sbh + norm_out + 2 * drop * sbh
    # the MLP a token: fc1's output (2f gated, else f) kept by the activation function, and
    # fc2's input (the activation's output)
    mlp_per_f = (2 if model.gated else 1) * e + li
    if moe:
        k = model.top_k
        # "moe_act": the experts' activation output (fc2's input) recomputed from fc1's
        routed_f = (2 * e if model.gated else e) + (0.0 if "moe_act" in modules else li)
        routed = k * (li * sbh + routed_f * s * b * model.moe_ffn)
        shared = mlp_per_f * s * b * model.shared_expert_ffn_hidden
        if "moe" in modules:            # the whole MoE block again from its input
            routed = shared = 0.0
        elif "shared_experts" in modules:
            shared = 0.0
        mlp = routed + shared
        fc2_in = li * (k * s * b * model.moe_ffn + s * b * model.shared_expert_ffn_hidden)
        routed_in = k * li * sbh
    else:
        # "mlp": the dense MLP again from its input (the norm's output, kept)
        mlp = 0.0 if "mlp" in modules else mlp_per_f * s * b * model.ffn
        fc2_in = li * s * b * model.ffn
        routed_in = 0.0
    # "mla_up_proj": multi-latent attention's Q, K, V again from the kept latents
    qkv = 0.0 if ("mla_up_proj" in modules and model.is_mla) else \
        e * s * b * (q + 2 * kv)
    split = qkv + li * s * b * q + mlp
    if flash_attention:
        core = 4 * a * s * b
    else:
        core = (e + drop * (1 + e)) * a * s * s_full * b
    if ("core_attn" in modules and not flash_attention) or (
            cp > 1 and cp_comm == "all_gather"):
        # all-gather CP keeps only q, k, v: its backward recomputes the attention core
        core = 0.0
    total = replicated / sp + (split + core) / t
    wgrad = 2 * li * sbh / sp + (li * s * b * q + fc2_in + routed_in) / t
    return LayerActivations(total, wgrad)


def embedding_activations(model: ModelSpec, par: Parallelism) -> float:
    """First stage, beyond its layers: token ids ``8sb`` and the embedding dropout mask ``sbh``
    (Megatron's theoretical_memory_usage counts both)."""
    s = model.seq_length / par.cp
    b = par.micro_batch_size
    return (8 * s * b + (s * b * model.hidden if model.dropout else 0)) / par.sp


def head_activations(model: ModelSpec, par: Parallelism) -> float:
    """Last stage, beyond its layers: the final norm's input and output ``2e sbh`` and the fp32
    logits the loss keeps ``4sbV`` (Korthikanti et al. §4.3: ``4sbh(1 + V/h)`` in 16-bit),
    vocabulary (padded, `ModelSpec.padded_vocab`) split over tp."""
    s = model.seq_length / par.cp
    b = par.micro_batch_size
    e = activation_element_bytes(par)
    return (2 * e * s * b * model.hidden / par.sp
            + 4 * s * b * model.padded_vocab(par.tp) / par.tp)


def param_bytes(precision: str, zero: int, dense: float, expert: float, d: int, d_expert: int,
                *, per_param: tuple[int, int, int] | None = None,
                grads_sharded: bool | None = None) -> dict[str, float]:
    """Weights, gradients and optimizer bytes of ``dense`` and ``expert`` parameters held by a
    rank, sharded over ``d`` (``d_expert``) data-parallel ranks as ``zero`` says.
    ``per_param``: the (weight, gradient, optimizer) bytes (default: the precision's
    `BYTES_PER_PARAM` row; a plan's: `bytes_per_param`); ``grads_sharded``: whether the
    gradients are held as a shard (default: ZeRO-2 and up; a plan's:
    `Parallelism.grads_sharded`)."""
    w, g, o = BYTES_PER_PARAM[precision] if per_param is None else per_param
    sharded = zero >= 2 if grads_sharded is None else grads_sharded

    def share(n: float, dd: int) -> tuple[float, float, float]:
        return (w * n / (dd if zero >= 3 else 1), g * n / (dd if sharded else 1),
                o * n / (dd if zero >= 1 else 1))

    a, b = share(dense, d), share(expert, d_expert)
    return {"weights": a[0] + b[0], "gradients": a[1] + b[1], "optimizer": a[2] + b[2]}
