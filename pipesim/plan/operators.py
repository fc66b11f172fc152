"""A layer as its operators, each timed as a roofline and summed per F, I and W.

Why: one efficiency curve of ``hidden / tp`` cannot tell a tp-1 model of hidden 2k from a tp-8
model of hidden 16k (same ``w``): memory-bound operators (norms, dropout, residuals, the
activation, softmax without flash attention), kernel launches and GEMM shapes differ. Here every
operator of one layer, for one microbatch on one rank of its tensor/context-parallel group,
carries its FLOPs, the bytes it moves and (for a GEMM) its ``m, n, k``; its time is

    max(flops / (peak(precision) * eff_gemm(m, n, k)), bytes / (hbm_bw * mem_efficiency))
        + launch_overhead

with the hardware's figures (:class:`pipesim.hardware.Hardware`). Per pass:

* F: every operator's forward;
* I (input gradient): each GEMM's data gradient (same FLOPs, ``m x k`` output), the attention
  core's backward (flash attention: five matmuls to the forward's two, 2.5x its FLOPs, as Dao's
  FlashAttention-2 paper counts them; without it, twice its two batched GEMMs), the element-wise
  backward (more bytes: it reads the saved input and the incoming gradient);
* W (weight gradient): each GEMM with weights once more, ``k x n`` output over the ``m`` tokens.

GEMM FLOPs equal :mod:`pipesim.plan.flops` term by term (QKV with GQA, output projection, the
MLP's two or three matrices, top-k experts and a shared expert), so MFU's numerator is
unchanged; the MoE router's small GEMM is timed but, as in Megatron's count, not in MFU.
Precision: bf16/fp16 GEMMs at the bf16 dense peak, fp32 at the fp32 peak (default half the
bf16 one: TF32); the low precisions (``fp8``: per-tensor scaling, current or delayed;
``mxfp8``: 1x32 block scaling; ``nvfp4``: 1x16 block-scaled FP4) at their own dense peak
(:meth:`pipesim.hardware.Hardware.precision_peak`) times their own large-shape efficiency
(``precision_e_max``), plus the quantize kernels of their inputs (`CAST_BYTES`: the input
in F, the output gradient in I, each read and written as the recipe does, at
``cast_efficiency`` of the HBM bandwidth). MFU stays against the bf16 peak (its definition),
so an fp8 plan's MFU can exceed what a bf16 GEMM could reach. The output layer and the MoE
router run in bf16 in every recipe (Transformer Engine quantizes the transformer layers'
linear layers only). The routed experts run as one grouped GEMM, each group at the
hardware's ``grouped_gemm_efficiency`` of a dense GEMM of its shape (scheduling many small
groups, the per-expert token counts read back, padding). Attention runs in bf16: flash attention as one
kernel at ``flash_e_max * s/(s + 256) * head_dim factor`` (causal: the masked half skipped;
not under all-gather CP, whose attention takes an explicit mask over the gathered sequence),
or, without it, two batched GEMMs with softmax and dropout over the ``s x s`` scores.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .model import ModelSpec
from .parallelism import Parallelism


# Bytes a quantize kernel moves per element of a low-precision GEMM's input, by recipe
# (Transformer Engine): fp8 current scaling reads the bf16 tensor twice (amax, then cast) and
# writes the fp8 copy and its transpose (for the other GEMM of the backward): 2 + 2 + 1 + 1;
# mxfp8 reads once and writes row- and column-wise copies with one E8M0 scale per 32 values:
# 2 + 2 * (1 + 1/32); nvfp4 reads once (plus the random Hadamard transform's pass over the
# weight-gradient input) and writes two 4-bit copies with one E4M3 scale per 16 values and a
# per-tensor amax pass: 2 + 2 + 2 * (0.5 + 1/16).
CAST_BYTES = {"fp8": 6.0, "mxfp8": 2.0 + 2 * (1 + 1 / 32), "nvfp4": 4.0 + 2 * (0.5 + 1 / 16)}

# Memory passes over a MoE layer's routed copies (T k h), by token dispatcher (see layer_ops)
PERMUTE_PASSES = {"alltoall": 4, "deepep": 2, "hybridep": 0}

# Operators each selective-recomputation module runs again in the backward (Megatron-Core's
# recompute_modules; "core_attn" is the attention core, priced in pipesim.plan.derive; "mlp" is
# a dense layer's MLP, "moe" a MoE layer's router, permutes, experts and shared expert, whose
# dispatch derive adds too). Megatron's "layernorm" recomputes the two norms of a layer.
RECOMPUTED_OPS = {
    "layernorm": ("norm1", "norm2"),
    "mla_up_proj": ("q_up", "kv_up", "rotary"),
    "mlp": ("fc1", "activation", "fc2"),
    "moe_act": ("expert_activation",),
    "moe": ("router", "permute", "expert_fc1", "expert_activation", "expert_fc2",
            "shared_fc1", "shared_activation", "shared_fc2"),
    "shared_experts": ("shared_fc1", "shared_activation", "shared_fc2"),
}


def recomputed_ops(ops: list["Op"], modules) -> list["Op"]:
    """The operators of ``ops`` that recomputing ``modules`` runs again (`RECOMPUTED_OPS`)."""
    names = {n for m in modules for n in RECOMPUTED_OPS.get(m, ())}
    return [o for o in ops if o.name in names]


# Flash attention's backward over its forward, in FLOPs: it recomputes the scores and runs
# five matmuls to the forward's two (Dao 2023, FlashAttention-2, section 4: "the backward pass
# ... 2.5x the forward"). MFU still counts the backward as twice the forward (Megatron's).
FLASH_BACKWARD = 2.5


@dataclass(frozen=True)
class Op:
    """One operator of a layer on one rank: forward FLOPs and bytes; ``shape`` (m, n, k) for a
    GEMM (None: element-wise); ``kind`` gemm / attention / memory; ``weights``: has a W pass."""

    name: str
    kind: str
    flops: float
    bytes: float
    shape: tuple[float, float, float] | None = None
    weights: bool = False
    batch: float = 1.0              # batched GEMMs (attention without flash): how many
    bwd_bytes: float | None = None  # element-wise backward bytes (default 1.5x the forward's)
    counted: bool = True            # in model FLOPs (MFU); the router is not
    quantized: bool = True          # a GEMM in the plan's precision (output layer, router: bf16)
    grouped: bool = False           # one of a grouped GEMM's groups (the routed experts)


@dataclass(frozen=True)
class PassTimes:
    """Seconds of F, I and W for one layer (or head) and one microbatch, and their FLOPs."""

    F: float
    I: float
    W: float
    gemm_F: float = 0.0     # seconds of F in GEMMs (for the efficiency reported)
    flops_F: float = 0.0


def layer_key(par: Parallelism) -> tuple:
    """The values of ``par`` a layer's operators depend on (:func:`layer_ops` reads these
    alone): plans that differ only in pp, vpp, dp, ZeRO, recomputation or the batch share them."""
    return (par.tp, par.sp, par.cp, par.micro_batch_size, par.precision, par.flash_attention,
            par.cp_comm, par.ep, par.ep_dispatcher)


def layer_ops(model: ModelSpec, par: Parallelism, moe: bool = False) -> list[Op]:
    """The operators of one transformer layer, one microbatch, one tp x cp rank."""
    return list(_layer_ops(model, bool(moe), *layer_key(par)))


def layer_rooflines(model: ModelSpec, par: Parallelism, hw, moe: bool = False
                    ) -> tuple[tuple[Op, ...], PassTimes, PassTimes]:
    """A layer's operators, their pass times and the attention core's alone (its operators:
    ``attention``, ``softmax``, ``attention_dropout``), made once per distinct layer: a search
    derives thousands of plans whose layers are the same few (`layer_key`)."""
    return _layer_rooflines(model, hw, bool(moe), *layer_key(par))


# Pure functions of immutable values, asked for every plan a search derives: each made once per
# distinct argument (as pipesim.plan.flops's counts)
@lru_cache(maxsize=4096)
def _layer_rooflines(model: ModelSpec, hw, moe: bool, *key) -> tuple[tuple[Op, ...], PassTimes,
                                                                      PassTimes]:
    ops = _layer_ops(model, moe, *key)
    precision = key[4]
    attention = [o for o in ops if o.kind == "attention"
                 or o.name in ("softmax", "attention_dropout")]
    return ops, pass_times(list(ops), hw, precision), pass_times(attention, hw, precision)


@lru_cache(maxsize=4096)
def _layer_ops(model: ModelSpec, moe: bool, t: int, sp: int, cp: int, b: int, precision: str,
               flash_attention: bool, cp_comm: str, ep: int, ep_dispatcher: str
               ) -> tuple[Op, ...]:
    e = 2 if precision != "fp32" else 4
    s_full = model.seq_length
    T = b * s_full / cp                  # tokens a rank holds (after the tp all-gather)
    R = T / sp                           # tokens of the replicated region (sequence-parallel shard)
    h, q, kv, a, d = model.hidden, model.q_size, model.kv_size, model.heads, model.kv_channels
    drop = 1 if model.dropout else 0
    ops: list[Op] = []

    def gemm(name: str, m: float, n: float, k: float, counted: bool = True) -> None:
        ops.append(Op(name, "gemm", 2 * m * n * k, e * (m * k + k * n + m * n), (m, n, k),
                      weights=True, counted=counted, quantized=counted))

    def mem(name: str, fwd: float, bwd: float | None = None) -> None:
        ops.append(Op(name, "memory", 0.0, fwd, bwd_bytes=bwd))

    # attention block
    mem("norm1", 2 * e * R * h, 3 * e * R * h)
    shapes = model.attention_weight_shapes()
    for name, k_in, n_out in shapes[:-1]:          # QKV, or MLA's down/up projections
        gemm(name, T, n_out / t, k_in)
        if name in ("q_down", "kv_down"):          # MLA: the latent's RMSNorm
            mem(f"{name}_norm", 2 * e * T * n_out / t, 3 * e * T * n_out / t)
    if model.position == "rotary":
        mem("rotary", 2 * e * T * (q + kv) / t, 2 * e * T * (q + kv) / t)
    heads = a / t
    s_loc = s_full / cp
    # all-gather CP (pipeexec's) attends the local queries to the whole gathered sequence
    # with an explicit (s/cp, s) mask: a masked kernel computes every block, skipping none
    skip = 1 if (cp > 1 and cp_comm == "all_gather") else 2
    if flash_attention:
        # causal: the masked half skipped; MLA's widths and sliding windows as flops.py counts
        flops = 4 * b * s_loc * model.attention_span(s_full) * model.attention_width / t / skip
        ops.append(Op("flash_attention", "attention", flops,
                      e * T * (2 * q + 2 * kv) / t, (s_loc, s_full, d)))
    else:
        batch = b * heads
        scores = b * heads * s_loc * s_full
        ops.append(Op("scores", "attention", 2 * batch * s_loc * s_full * d,
                      e * (batch * (s_loc * d + s_full * d) + scores), (s_loc, s_full, d), batch=batch))
        mem("softmax", 2 * e * scores, 3 * e * scores)
        if drop:
            mem("attention_dropout", (2 * e + 1) * scores, (2 * e + 1) * scores)
        ops.append(Op("context", "attention", 2 * batch * s_loc * s_full * d,
                      e * (batch * (s_full * d + s_loc * d) + scores), (s_loc, d, s_full), batch=batch))
    _, k_in, _ = shapes[-1]
    gemm("proj", T, h, k_in / t)
    mem("bias_dropout_add1", (3 * e + drop) * R * h, (2 * e + drop) * R * h)
    # MLP block
    mem("norm2", 2 * e * R * h, 3 * e * R * h)
    act_in = 2 if model.gated else 1

    def mlp(prefix: str, tokens: float, ffn: float, m_per_gemm: float) -> None:
        gemm(f"{prefix}fc1", m_per_gemm, act_in * ffn / t, h)
        mem(f"{prefix}activation", (act_in + 1) * e * tokens * ffn / t,
            (2 * act_in + 1) * e * tokens * ffn / t)
        gemm(f"{prefix}fc2", m_per_gemm, h, ffn / t)

    if moe:
        k, E = model.top_k, model.experts
        gemm("router", T, E, h, counted=False)
        # the permutes of the k routed copies, each a read and a write of T k h (Megatron's
        # token_dispatcher.py): DeepEP permutes them for the experts after its dispatch and
        # back before its combine (2); the all-to-all dispatcher permutes before the exchange
        # and unpermutes after it, and with several experts a rank sorts the received chunks
        # by expert and back (sort_chunks_by_idxs: 4); HybridEP does both inside its
        # dispatch and combine kernels (0)
        passes = PERMUTE_PASSES[ep_dispatcher]
        if ep_dispatcher == "alltoall" and (ep == 1 or E <= ep):
            passes = 2
        if passes:
            mem("permute", passes * 2 * e * T * k * h, passes * 2 * e * T * k * h)
        routed = T * k                                  # token copies a rank's experts take
        local = max(1.0, E / ep)
        # grouped GEMM: the local experts' FLOPs, each expert's m its share of the copies
        fc1_before = len(ops)
        mlp("expert_", routed, model.moe_ffn, routed / local)
        for i in range(fc1_before, len(ops)):
            o = ops[i]
            if o.kind == "gemm":     # FLOPs of all local experts: one GEMM's shape, `local` times
                m, n, kk = o.shape
                ops[i] = Op(o.name, "gemm", 2 * routed * n * kk,
                            e * (routed * kk + local * kk * n + routed * n), o.shape, weights=True,
                            grouped=True)
        if model.shared_expert_ffn_hidden:
            mlp("shared_", T, model.shared_expert_ffn_hidden, T)
    else:
        mlp("", T, model.ffn, T)
    mem("bias_dropout_add2", (3 * e + drop) * R * h, (2 * e + drop) * R * h)
    return tuple(ops)


def head_ops(model: ModelSpec, par: Parallelism) -> list[Op]:
    """The last stage's final norm, output layer and (vocabulary-parallel) cross-entropy."""
    t, sp, b = par.tp, par.sp, par.micro_batch_size
    e = 2 if par.precision != "fp32" else 4
    T = b * model.seq_length / par.cp
    V = model.padded_vocab(t) / t
    h = model.hidden
    return [Op("final_norm", "memory", 0.0, 2 * e * T / sp * h, bwd_bytes=3 * e * T / sp * h),
            Op("logits", "gemm", 2 * T * V * h, e * (T * h + h * V + T * V), (T, V, h), weights=True,
               quantized=False),
            # fp32 softmax over the logits: read them, write the probabilities; backward writes
            # the gradient of the logits
            Op("cross_entropy", "memory", 0.0, (e + 2 * 4) * T * V, bwd_bytes=(4 + e) * T * V)]


def embedding_ops(model: ModelSpec, par: Parallelism) -> list[Op]:
    """The first stage's embedding lookup (and its gradient's scatter-add)."""
    e = 2 if par.precision != "fp32" else 4
    T = par.micro_batch_size * model.seq_length / par.cp / par.sp
    return [Op("embedding", "memory", 0.0, 2 * e * T * model.hidden,
               bwd_bytes=2 * e * T * model.hidden)]


def flash_efficiency(hw, s: float, head_dim: float) -> float:
    """Flash attention's fraction of the bf16 peak: ``flash_e_max`` at long sequences and head
    dim 128, lower at short sequences (fixed per-tile costs) and small head dims."""
    return hw.flash_e_max * (s / (s + 256.0)) * (head_dim / (head_dim + 16.0)) / (128 / 144)


def pass_times(ops: list[Op], hw, precision: str) -> PassTimes:
    """Sum the operators' roofline times per pass (see the module docstring)."""
    bf16 = hw.fp32_peak_flops if precision == "fp32" else hw.peak_flops
    low = precision in CAST_BYTES
    low_peak = hw.precision_peak(precision) if low else bf16
    mem_rate = hw.hbm_bandwidth * hw.mem_efficiency
    cast_rate = hw.hbm_bandwidth * (hw.mem_efficiency if hw.cast_efficiency is None
                                    else hw.cast_efficiency)
    launch = hw.launch_overhead
    F = I = W = gF = flops_F = 0.0

    def gemm_rate(o: Op, m: float, n: float, k: float) -> float:
        # the routed experts' grouped GEMM: a fraction of a dense GEMM's efficiency
        grouped = hw.grouped_gemm_efficiency if o.grouped else 1.0
        if low and o.quantized:
            return low_peak * hw.gemm_efficiency(m, n, k, precision, o.grouped) * grouped
        return bf16 * hw.gemm_efficiency(m, n, k, grouped=o.grouped) * grouped

    for o in ops:
        if o.kind == "memory":
            F += o.bytes / mem_rate + launch
            I += (1.5 * o.bytes if o.bwd_bytes is None else o.bwd_bytes) / mem_rate + launch
            continue
        if o.kind == "attention":
            if o.batch == 1.0:          # flash attention: one kernel
                rate = bf16 * flash_efficiency(hw, o.shape[1], o.shape[2])
                tf = max(o.flops / rate, o.bytes / mem_rate) + launch
                F += tf
                I += max(FLASH_BACKWARD * o.flops / rate, 2 * o.bytes / mem_rate) + launch
            else:                       # batched GEMM over the scores
                m, n, k = o.shape
                rate = bf16 * hw.gemm_efficiency(m, n, k)
                tf = max(o.flops / rate, o.bytes / mem_rate) + launch
                F += tf
                I += 2 * tf
            gF += tf
            flops_F += o.flops
            continue
        m, n, k = o.shape
        # each GEMM's share of its grouped copies (a grouped GEMM's flops are `local` GEMMs')
        cast_f = cast_i = 0.0
        if low and o.quantized:
            per = CAST_BYTES[precision]
            rows = o.flops / (2 * n * k)          # tokens through this GEMM (all its groups)
            cast_f = per * rows * k / cast_rate + launch       # its input
            cast_i = per * rows * n / cast_rate + launch       # the gradient of its output
        tf = max(o.flops / gemm_rate(o, m, n, k), o.bytes / mem_rate) + launch + cast_f
        # data gradient: output m x k, reduction over n; weight gradient: k x n over m tokens
        ti = max(o.flops / gemm_rate(o, m, k, n), o.bytes / mem_rate) + launch + cast_i
        tw = max(o.flops / gemm_rate(o, k, n, m), o.bytes / mem_rate) + launch
        F += tf
        I += ti
        W += tw
        gF += tf
        flops_F += o.flops
    return PassTimes(F, I, W, gF, flops_F)
