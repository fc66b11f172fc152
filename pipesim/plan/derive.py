"""``plan.costs()``: a plan's per-stage :class:`pipesim.CostModel`, with the parts it is made of.

Pure and cheap (no simulation; a few list operations per stage), so a planner can derive
thousands. For each stage and one microbatch on one rank of its tensor/context-parallel group:

* compute: each layer's operators (:mod:`pipesim.plan.operators`: GEMMs by shape, attention,
  the memory-bound norms, activations, dropout, residuals, rotary, MoE permutes; embedding, head
  and cross-entropy), each a roofline on the hardware's figures, summed per F / I / W. A plan's
  constant ``efficiency`` replaces that model by the layers' FLOPs (:mod:`pipesim.plan.flops`)
  divided by ``tp * cp`` at ``peak * efficiency`` (GEMMs at the precision's own dense peak:
  fp8, mxfp8, nvfp4; attention matmuls at bf16 peak, causal halves with flash attention). Full recomputation adds each recomputed layer's forward (with its communication)
  to I; selective adds the attention matmuls (none with flash attention). The last stage adds
  the LM head (F, I and W each ``2 b s h V``);
* communication inside a layer, alpha-beta over the link the group crosses
  (:mod:`pipesim.plan.collectives`, :class:`pipesim.plan.cluster.Cluster`): TP two all-reduces
  of ``2 b s h`` bytes in F and two in I, or with sequence parallelism two all-gathers and two
  reduce-scatters (same bytes); added to the compute, or overlapped with it
  (``overlap_tp_comm``, Megatron's --tp-comm-overlap: with sequence parallelism each
  all-gather / reduce-scatter in tp chunks under its GEMM, :mod:`pipesim.plan.overlap`;
  without, the longer of the two). Hidden communication slows the compute it hides under by
  the hardware's processor usage (Calculon's model, :mod:`pipesim.plan.overlap`). CP
  (``cp_comm``): ``p2p``, the ring, moves K and V in F and their gradients in I overlapped
  with the attention matmuls (only the excess shows); ``all_gather`` (pipeexec's, Transformer Engine's all-gather CP) all-gathers K and V
  in F, and in I gathers them again, recomputes the attention core's forward and
  reduce-scatters dK/dV, all exposed, its attention (local queries against the gathered
  sequence under an explicit mask) computing every block, with a transient of the whole
  sequence's K/V and their gradients (``2 * 2 e b s kv / t``) per rank. EP: two all-to-alls
  of the ``k`` routed copies (dispatch, combine) in F and two in I per MoE layer, and in F the
  per-expert counts' all-to-all (``8 E`` bytes a rank) that sizes them (dropless: variable
  splits); with the flex dispatcher (``ep_dispatcher`` deepep / hybridep) one copy a destination rank and
  one a remote domain (:func:`pipesim.plan.collectives.flex_dispatch`); with
  ``overlap_ep_comm`` (Megatron's EP overlap) hidden under the layer's compute but what does
  not fit and what hiding costs (:mod:`pipesim.plan.overlap`);
* ZeRO-2/3: not in F / I / W. They are actions of the plan's program (``Plan.build_schedule``
  lowers the schedule with ``Parallelism.sharding``, :mod:`pipesim.schedule.sharding`, the
  program pipeexec runs), priced here per stage and timed by the simulator on each rank's
  lane: ``unshard``, the ZeRO-3 all-gather of the stage's weights (the weights' bytes), and
  ``reduce_grad``, the reduce-scatter of one backward's gradients (the gradients' bytes), dense
  parameters over dp x cp, experts over their expert-data-parallel group, each the sum over
  the stage's units, gathered and reduced one at a time, streamed with the computations
  (``unshard_units``, ``reduce_grad_units``; the reduction only with ``overlap_grad_reduce``):
  under ZeRO-3 (FSDP) and ZeRO-2 once a microbatch a layer (the embedding, the head, an MTP
  module), under ZeRO-2 once a step (Megatron's distributed optimizer) Megatron-Core DDP's
  buckets (:func:`megatron_buckets`); the rank waits for
  each reduction once a microbatch (``overlap_reduce_grad`` 0), the step's end once a step;
* point-to-point: one activation ``2 b s h / sp`` bytes (Megatron sends the sequence-parallel
  shard) over the pipeline group's link;
* memory: activations per stage and microbatch (:mod:`pipesim.plan.footprint`), the share W
  still needs after I, weights + gradients + optimizer state per stage, and per-rank transient
  buffers (one layer's recomputed activations with full recomputation, two gathered layers
  with ZeRO-3, their gradients too when reduced once a microbatch, and ZeRO-2's one bucket, a
  layer's gradients, then);
* the step tail per rank: the data-parallel gradient all-reduce (ZeRO-1: reduce-scatter; ZeRO-2/3
  reduce in their REDUCE_GRAD actions instead; with sharded optimizer below ZeRO-3, the
  parameter all-gather) over the dp x cp group, overlapped with the
  last microbatch's backward (``overlap_grad_reduce``: all but what that window cannot hide,
  at least the last bucket, :func:`megatron_buckets`) and the next forward
  (``overlap_param_gather``), the
  experts' over their own expert-data-parallel group (``dp x cp / ep`` ranks ``ep`` apart:
  across nodes, one GPU a node on its own NIC), and
  an optimizer step bound by HBM bandwidth (28 bytes read and written per parameter updated).

The CostModel carries what the engine reads; its ``grad_bytes`` / ``dp_*`` / ``optimizer``
keep the engine's own (non-overlapped, all-reduce) step tail usable, while
:func:`pipesim.sim.plan_report.simulate_plan` adds the overlap-aware tail computed here.
"""
from __future__ import annotations

import math
from collections import Counter

from dataclasses import dataclass, field

from .costs import CostModel
from ..errors import PlanError, ScheduleError
from ..hardware import LOW_PRECISIONS
from ..schedule.placement import LOOPED, rank_parts as placed_parts
from ..schedule.registry import schedule_rank_parts
from ..schedule.schedule import Schedule
from . import collectives as coll
from .cluster import Link
from .operators import embedding_ops, head_ops, layer_rooflines, pass_times, recomputed_ops
from .overlap import added, usage
from .parallelism import FLEX_DISPATCHERS
from .flops import head_flops, layer_flops, model_flops, recompute_flops
from .footprint import (
    activation_element_bytes,
    bytes_per_param,
    embedding_activations,
    head_activations,
    layer_activations,
    param_bytes,
    SAVED_INPUT_BYTES,
)

BUCKET_PARAMS = 40e6          # Megatron DDP bucket floor (bucket_size default: max(40M, 1M * dp))
OPTIMIZER_BYTES = 28          # Adam: bytes read + written per parameter updated


def ep_overlap_unpaired(pp: int, microbatches: int) -> float:
    """The fraction of a rank's forwards (and as many backwards) that Megatron's EP overlap
    leaves unpaired, their exchanges exposed, averaged over the pipeline's ranks.

    Megatron-Core's combined 1F1B (pipeline_parallel/combined_1f1b.py, schedules.py
    ``get_pp_rank_microbatches``, NVIDIA/Megatron-LM d98e8a6) pairs the forward of one
    microbatch with the backward of another in the 1F1B steady state only. Without pipelining
    the first forward and the last backward run alone (one of ``m``); interleaved, rank ``r``
    warms up with ``2 (pp - r - 1) + (vpp - 1) pp + 1`` of its ``m vpp`` forwards (the
    overlap adds the one) and cools down with as many backwards: ``vpp pp`` on average, so
    ``pp / m`` of them (at most all) in both cases."""
    return min(1.0, pp / microbatches)


def megatron_buckets(params: float, dp: int, *, first_chunk: bool = True,
                     overlap_grad_reduce: bool = True) -> int:
    """How many buckets Megatron-Core's DDP cuts ``params`` (one gradient buffer of a model
    chunk, on one rank) into: ``bucket_size`` defaults to ``max(40M, 1M * dp)`` parameters (dp:
    the data-parallel group without cp), one bucket without ``overlap_grad_reduce``, and one
    on every chunk but the first pipeline rank's first (its reduction is off the critical
    path); megatron/core/distributed/distributed_data_parallel.py (DistributedDataParallel
    .__init__), megatron/training/training.py (per_chunk_bucket_sizes). At least 1."""
    if not (overlap_grad_reduce and first_chunk) or params <= 0:
        return 1
    return max(1, math.ceil(params / max(BUCKET_PARAMS, 1e6 * dp)))


@dataclass(frozen=True)
class RankTail:
    """One pipeline rank's step tail, after its last pipeline action (seconds)."""

    dp_comm: float          # data-parallel gradient reduction below ZeRO-2 (ZeRO-2/3 reduce in
    #                         the program's REDUCE_GRAD), + the parameter gather of ZeRO-1/2
    dp_exposed: float       # what of it (and of tied_comm) the backward does not hide
    tied_comm: float        # gradient sum of parts held by two ranks (dualpipe's copies)
    optimizer: float        # the optimizer step, HBM-bound

    @property
    def seconds(self) -> float:
        """What the tail adds to the rank's step: exposed communication, then the optimizer."""
        return self.dp_exposed + self.optimizer


@dataclass(frozen=True)
class PlanCosts:
    costs: CostModel
    stage_layers: list[int]
    efficiency: float
    links: dict[str, Link]
    stage_params: list[dict[str, float]]          # per stage, on one rank: dense / expert
    stage_memory: list[dict[str, float]]          # per stage: weights / gradients / optimizer
    rank_buffers: list[float]                     # per pipeline rank: transient bytes
    tail: list[RankTail]                          # per pipeline rank
    comm: dict[str, float] = field(default_factory=dict)   # per microbatch, whole pipeline: seconds
    # per stage, per pass ("F", "I", "W"), each group's ("tp", "cp", "ep") collective seconds inside
    # the layers, the embedding and the output layer for one microbatch (what of it is exposed
    # depends on the overlap settings)
    stage_comm: list[dict[str, dict[str, float]]] = field(default_factory=list)
    model_flops: float = 0.0                      # per step, all GPUs (Korthikanti eq. 7)
    hardware_flops: float = 0.0                   # per step, with recomputation
    calibration: str = "fitted"                   # the hardware's: fitted / measured / extrapolated;
    #                                               "constant": the plan's own efficiency

    @property
    def extrapolated(self) -> bool:
        """True when the times rest on efficiency figures not fitted or measured on this GPU."""
        return self.calibration == "extrapolated"


def derive(plan) -> PlanCosts:
    model, par, cluster = plan.model, plan.parallelism, plan.cluster
    hw = cluster.hardware
    t, cp, sp, b = par.tp, par.cp, par.sp, par.micro_batch_size
    s = model.seq_length
    layers = plan.stage_layers()
    n = len(layers)
    links = cluster.group_links(par)
    per_op = plan.efficiency is None
    eff = plan.efficiency if not per_op else 1.0
    bf16_rate = hw.peak_flops * eff
    if par.precision in LOW_PRECISIONS:
        refusal = hw.precision_refusal(par.precision)
        if refusal:
            raise PlanError(f"parallelism.precision: {refusal}")
        # at the precision's own peak (MFU stays against the bf16 peak; see operators.py)
        gemm_rate = hw.precision_peak(par.precision) * eff
    elif par.precision == "fp32":
        gemm_rate = bf16_rate = hw.fp32_peak_flops * eff
    else:
        gemm_rate = bf16_rate
    shard = t * cp
    e = activation_element_bytes(par)                     # 4 in fp32, else 2
    act_bytes = e * b * (s / cp) * model.hidden           # one activation on one cp rank
    pattern = model.moe_pattern()
    d, d_exp = par.dp * cp, max(1, par.dp * cp // par.ep)

    # per-layer-kind pieces (dense, moe), each (F, I_extra_for_recompute, I, W) seconds
    # Transformer Engine quantizes a linear layer's input before sequence parallelism's
    # all-gather and its output gradient before the backward's (module/linear.py,
    # gather_along_first_dim with the quantizer; userbuffers likewise): in FP8 / MXFP8 / NVFP4
    # those move the quantized bytes (SAVED_INPUT_BYTES an element); the reduce-scatters bf16
    gathered_bytes = act_bytes * SAVED_INPUT_BYTES.get(par.precision, e) / e
    tp_ag = coll.all_gather(gathered_bytes, t, links["tp"]) if par.sequence_parallel else 0.0
    tp_rs = coll.reduce_scatter(act_bytes, t, links["tp"]) if par.sequence_parallel else 0.0
    tp_one = tp_ag + tp_rs if par.sequence_parallel else coll.all_reduce(act_bytes, t, links["tp"])
    # userbuffers' overlap needs sequence parallelism (Megatron refuses --tp-comm-overlap
    # without it); without, the older bound: the longer of compute and communication
    userbuffers = par.overlap_tp_comm and par.sequence_parallel and t > 1
    u_tp, u_cp, u_dp, u_ep = (usage(links[k], hw) for k in ("tp", "cp", "dp", "ep"))
    tp_pass = 2 * tp_one                                  # two per pass (attention, MLP)
    kv_bytes = 2 * e * b * s * model.kv_size / t          # K and V, whole sequence, per tp rank
    gathered = par.cp_comm == "all_gather"
    cp_pass = coll.all_gather(kv_bytes, cp, links["cp"])
    # all_gather (pipeexec's): F gathers K/V; I gathers them again and reduce-scatters dK/dV
    cp_f, cp_i = ((cp_pass, cp_pass + coll.reduce_scatter(kv_bytes, cp, links["cp"]))
                  if gathered else (cp_pass, cp_pass))
    # EP (dropless, pipeexec's and Megatron's all-to-all dispatcher): per MoE layer, F
    # exchanges the per-expert token counts (E int64 a rank), then dispatches each token's k
    # copies to their experts' ranks and combines the outputs back; I runs the two reverse
    # (the flex dispatcher, DeepEP / HybridEP: one copy a destination rank, one a remote
    # domain, pipesim.plan.collectives.flex_dispatch)
    if model.is_moe and par.ep_dispatcher in FLEX_DISPATCHERS:
        ep_pass = 2 * coll.flex_dispatch(act_bytes / sp, model.top_k, model.experts, par.ep,
                                         links["ep"])
    elif model.is_moe:
        ep_pass = 2 * coll.all_to_all(model.top_k * act_bytes / sp, par.ep, links["ep"])
    else:
        ep_pass = 0.0
    ep_f = ep_pass + (coll.all_to_all(8 * model.experts, par.ep, links["ep"]) if model.is_moe else 0.0)
    wbytes, gbytes, _ = bytes_per_param(par)
    per_mb = par.grads_sharded          # ZeRO-2/3 reduce-scatter inside every backward

    def zero_gather(dense: float, expert: float) -> float:
        """ZeRO-3: all-gather these parameters' weights whole (0 below ZeRO-3)."""
        if par.zero < 3:
            return 0.0
        return (coll.all_gather(wbytes * dense, d, links["dp"])
                + coll.all_gather(wbytes * expert, d_exp, links["edp"]))

    def zero_reduce(dense: float, expert: float) -> float:
        """ZeRO-2/3: reduce-scatter one backward's gradients of these parameters (0 below)."""
        if par.zero < 2:
            return 0.0
        return (coll.reduce_scatter(gbytes * dense, d, links["dp"])
                + coll.reduce_scatter(gbytes * expert, d_exp, links["edp"]))

    def kind(moe: bool) -> dict[str, float]:
        lf = layer_flops(model, b, moe=moe, causal=par.flash_attention)   # flash skips masked blocks
        # all-gather CP's attention takes an explicit mask over the gathered sequence: every
        # block computed (the time; the model FLOPs stay those of causal attention)
        masked = 2.0 if gathered and cp > 1 and par.flash_attention else 1.0
        g, a = lf.gemm / shard / gemm_rate, masked * lf.attention / shard / bf16_rate
        lp = model.layer_params(moe)
        lp_rank = lp["dense"] / t + lp["expert"] / (t * par.ep)
        ep, ep_b = (ep_f, ep_pass) if moe else (0.0, 0.0)

        def op(compute: float, attn: float, tp_c: float, cp_c: float, extra: float,
               tp_ub: float) -> float:
            if userbuffers:         # what the GEMMs cannot hide, and what hiding costs them
                x = compute + tp_ub
            else:
                x = max(compute, tp_c) if par.overlap_tp_comm else compute + tp_c
            # p2p: the ring's transfers hide behind the attention, only the excess shows (and
            # the attention slowed by what it hides); all_gather: the exchange happens before
            # (F) / around (I) the attention, exposed
            return x + (cp_c if gathered else added(cp_c, attn, u_cp)) + extra

        # the operators, their rooflines and the attention core's (pipesim.plan.operators)
        ops, pt, at = layer_rooflines(model, par, hw, moe)
        if per_op:
            a = at.F
            a_i = at.I
            achieved = lf.forward / shard / (pt.F * hw.peak_flops)
            comp_f, comp_i, comp_w = pt.F, pt.I, pt.W
        else:
            a_i = 2 * a
            achieved = eff
            comp_f, comp_i, comp_w = g + a, g + 2 * a, g
        # all_gather keeps only q, k, v: the backward recomputes the attention core's forward
        recomputed_attention = a if gathered and cp > 1 else 0.0
        gemms = {o.name: o for o in ops if o.kind == "gemm"}

        def gemm_pass(name: str, pass_: str) -> float:
            """One GEMM's seconds in one pass (F, I or W)."""
            o = gemms.get(name) or gemms.get("expert_" + name)
            if o is None:
                return 0.0
            if not per_op:
                return o.flops / gemm_rate
            pt = pass_times([o], hw, par.precision)
            return {"F": pt.F, "I": pt.I, "W": pt.W}[pass_]

        ub_f = ub_i = 0.0
        if userbuffers:
            # Megatron's --tp-comm-overlap (userbuffers, with sequence parallelism): each
            # all-gather in tp chunks under the GEMM that consumes it, each reduce-scatter
            # under the GEMM that produces it; in I the reverse collectives under the data
            # gradients' GEMMs (pipesim.plan.overlap)
            ub_f = sum(added(c, gemm_pass(n, "F"), u_tp, t) for c, n in
                       ((tp_ag, "qkv"), (tp_rs, "proj"), (tp_ag, "fc1"), (tp_rs, "fc2")))
            ub_i = sum(added(c, gemm_pass(n, "I"), u_tp, t) for c, n in
                       ((tp_rs, "qkv"), (tp_ag, "proj"), (tp_rs, "fc1"), (tp_ag, "fc2")))
        # sequence parallelism keeps only the rank's chunk of a column-parallel GEMM's input
        # for the backward (Megatron-Core; Transformer Engine's Linear: backward_input_needs_
        # gather; pipeexec's _ChunkWeightGrad): its weight gradient gathers it again, in the
        # quantized bytes as the forward's gather, one all-gather for QKV and one for FC1.
        # Userbuffers' bulk overlap hides it under a GEMM (what it cannot hide shows);
        # without, it is exposed (pipeexec's W waits for it)
        tp_w = 2 * tp_ag                   # 0 without sequence parallelism (tp_ag is)
        regather = (sum(added(tp_ag, gemm_pass(n, "W"), u_tp, t) for n in ("qkv", "fc1"))
                    if userbuffers else tp_w)
        ep_x, ep_bx = ep, ep_b
        if par.overlap_ep_comm and ep + ep_b > 0:
            # Megatron's EP overlap (overlap_moe_expert_parallel_comm, with delay_wgrad_compute):
            # the forward of one microbatch and the backward of another run interleaved, each
            # one's dispatch / combine under the other's compute: the layer's F + I + W hide
            # its F and I exchanges, slowed by what they hide (pipesim.plan.overlap); what
            # shows is split between F and I as the exchanges are. Only the pairs of the
            # steady state overlap: the warmup's forwards and the cooldown's backwards run
            # alone, their exchanges exposed (ep_overlap_unpaired)
            alone = ep_overlap_unpaired(par.pp, par.microbatches)
            shown = (1 - alone) * added(ep + ep_b, comp_f + comp_i + comp_w, u_ep) \
                + alone * (ep + ep_b)
            ep_x, ep_bx = shown * ep / (ep + ep_b), shown * ep_b / (ep + ep_b)
        # selective recomputation's modules (the core attention apart): their forwards again
        # inside I, and a recomputed MoE block's dispatch and combine with them
        again = recomputed_ops(ops, par.recomputed_modules - {"core_attn"})
        if per_op:
            rec_f = pass_times(again, hw, par.precision).F if again else 0.0
        else:
            rec_f = sum(o.flops for o in again if o.kind == "gemm") / gemm_rate
        rec_ep = ep if (moe and "moe" in par.recomputed_modules) else 0.0
        rec_flops = sum(o.flops for o in again if o.counted and o.kind != "memory") * shard
        f = op(comp_f, a, tp_pass, cp_f, ep_x, ub_f)
        i = op(comp_i + recomputed_attention, a_i, tp_pass, cp_i, ep_bx, ub_i)
        return {"F": f, "I": i, "W": comp_w + regather, "attn": a, "params": lp_rank, "achieved": achieved,
                "rec_F": rec_f + rec_ep, "rec_ep": rec_ep, "rec_flops": rec_flops,
                # ZeRO's collectives of the layer, one unit of its stage's UNSHARD (the weights'
                # bytes) and REDUCE_GRAD (the gradients' bytes)
                "gather": zero_gather(lp["dense"] / t, lp["expert"] / (t * par.ep)),
                "reduce": zero_reduce(lp["dense"] / t, lp["expert"] / (t * par.ep)),
                "attn_recompute": recomputed_attention,
                # each group's collective seconds per pass (the exchange, whatever of it shows)
                "comm_F": {"tp": tp_pass, "cp": cp_f, "ep": ep},
                "comm_I": {"tp": tp_pass, "cp": cp_i, "ep": ep_b},
                "comm_W": {"tp": tp_w, "cp": 0.0, "ep": 0.0}}

    kinds = {False: kind(False), True: kind(True) if model.is_moe else None}
    if per_op:
        head_t = pass_times(head_ops(model, par), hw, par.precision)
        emb_t = pass_times(embedding_ops(model, par), hw, par.precision)
        head_f, head_i, head_w = head_t.F, head_t.I, head_t.W
        emb_f, emb_i = emb_t.F, emb_t.I
        eff = kinds[False]["achieved"]
    else:
        head_f = head_i = head_w = head_flops(model, b, tp=t) / shard / gemm_rate
        emb_f = emb_i = 0.0
    # the embedding's and the output layer's tp collectives per pass (both outside the
    # quantized layers: bf16 bytes). The embedding (vocabulary-parallel: each rank holds its
    # rows' lookups): its output all-reduced, or with sequence parallelism reduce-scattered and
    # the gradient all-gathered back. The output layer, column-parallel over the vocabulary
    # (Megatron's ColumnParallelLinear, pipeexec's lm_head): with sequence parallelism F
    # gathers the final norm's output, I reduce-scatters its gradient and W gathers the input
    # again (the rank keeps its chunk); without, I all-reduces the input gradient
    seq_par = par.sequence_parallel
    bf16_ag = coll.all_gather(act_bytes, t, links["tp"]) if seq_par else 0.0
    emb_comm = {"F": tp_rs if seq_par else tp_one, "I": bf16_ag, "W": 0.0}
    head_comm = {"F": bf16_ag, "W": bf16_ag,
                 "I": tp_rs if seq_par else coll.all_reduce(act_bytes, t, links["tp"])}

    fwd, inp, wgt, act, wfrac, params_st, mem_st = [], [], [], [], [], [], []
    buffers_stage = []
    # ZeRO-2/3 as the program's actions: per stage its UNSHARD (all-gather of its weights) and
    # REDUCE_GRAD (reduce-scatter of one backward's gradients), each the sum over the stage's
    # units (a layer, the embedding, the head, an MTP module) gathered / reduced one by one
    unshard_st, reduce_st, units_st, reduce_units_st = [], [], [], []
    # ZeRO-2 once a step is Megatron's distributed optimizer: its gradients reduced in DDP's
    # buckets (megatron_buckets), not a layer at a time as FSDP's ZeRO-3 (and DeepSpeed's
    # per-microbatch ZeRO-2, as pipeexec runs it) reduce them
    megatron_reduce = par.zero == 2 and not per_mb
    start = 0
    stage_comm: list[dict[str, dict[str, float]]] = []
    recomputed_total = 0
    # every layer of a kind (dense / MoE, its recomputation) has the same activations and
    # parameters: computed once per kind, not once per layer
    kind_acts: dict[tuple[bool, str], object] = {}
    kind_params = {moe: model.layer_params(moe) for moe in set(pattern)}

    def acts_of(moe: bool, rec: str):
        if (moe, rec) not in kind_acts:
            kind_acts[moe, rec] = layer_activations(model, par, moe, recompute=rec)
        return kind_acts[moe, rec]

    def layer_step(moe: bool, rec: str, offloaded: bool) -> tuple:
        """What one layer of a kind adds to its stage's sums, each value as the loop below adds
        it (so the same additions in the same order: the same sums): made once per (kind,
        recomputation, offloaded), where the loop runs once per layer of every plan a search
        derives."""
        k = kinds[moe]
        full, selective = rec == "full", rec == "selective"
        la = acts_of(moe, rec)
        lp = kind_params[moe]
        attn = (k["attn"] if selective and "core_attn" in par.recomputed_modules
                and not par.flash_attention and not k["attn_recompute"] else None)
        # Megatron's --cpu-offloading-num-layers (Transformer Engine's CPU offload): the first
        # layers' activations copied to host memory after their forward, back before their
        # backward, each copy under the next layer's compute (what it cannot hide shows), one
        # layer's in flight on the GPU
        copy = la.total / hw.host_bandwidth if offloaded else 0.0
        cf, ci, cw = k["comm_F"], k["comm_I"], k["comm_W"]
        groups = ("tp", "cp", "ep")
        return (k["F"], k["I"] + (k["F"] if full else 0.0),
                k["rec_F"] if selective else None, attn, k["W"],
                max(0.0, copy - k["F"]), max(0.0, copy - k["I"]),
                la.total if offloaded else None, la.total, la.weight_grad,
                acts_of(moe, "none").total if full else None,
                lp["dense"] / t, lp["expert"] / (t * par.ep), k["gather"], k["reduce"],
                tuple(cf[c] for c in groups),
                # full recomputation runs the forward's collectives again inside I
                tuple(ci[c] + (cf[c] if full else 0.0)
                      + (k["rec_ep"] if selective and c == "ep" else 0.0) for c in groups),
                tuple(cw[c] for c in groups),
                tuple(cf[c] + ci[c] + cw[c] for c in groups))

    steps: dict[tuple[bool, str, bool], tuple] = {}
    # the collectives' seconds per group (tp, cp, ep) over the whole pipeline
    c_tp = c_cp = c_ep = 0.0
    offload = par.offload_layers
    if offload and hw.host_bandwidth is None:
        raise PlanError(f"parallelism.offload_layers: {offload} layers' activations to host "
                        f"memory, but hardware {hw.name} names no host_bandwidth (the GPU's "
                        "link to host memory, bytes/s a direction): add it to the hardware "
                        "file, or set offload_layers to 0")
    for stage, count in enumerate(layers):
        if offload and count and offload >= count:
            raise PlanError(f"parallelism.offload_layers: {offload} must be below the layers of "
                            f"every stage (stage {stage} holds {count}); Megatron refuses "
                            "--cpu-offloading-num-layers >= a chunk's layers")
        f = i = w = a_bytes = w_bytes = 0.0
        dense_p = expert_p = 0.0
        gather_s = reduce_s = 0.0
        units = 0
        transient = 0.0
        f_tp = f_cp = f_ep = i_tp = i_cp = i_ep = w_tp = 0.0
        for j, moe in enumerate(pattern[start:start + count]):
            rec = par.recompute
            if rec == "full" and par.recompute_layers is not None and j >= par.recompute_layers:
                rec = "none"
            key = (moe, rec, j < offload)
            step = steps.get(key)
            if step is None:
                step = steps[key] = layer_step(*key)
            (df, di, dsel, dattn, dw, off_f, off_i, off_held, da, dwg, recomputed, dd, de, dg,
             dr, on_f, on_i, on_w, on_both) = step
            f += df
            i += di
            if dsel is not None:
                i += dsel
                if dattn is not None:
                    i += dattn
            w += dw
            if off_held is not None:
                f += off_f
                i += off_i
                transient = max(transient, off_held)
            else:
                a_bytes += da
                w_bytes += dwg
            if recomputed is not None:
                recomputed_total += 1
                transient = max(transient, recomputed)
            dense_p += dd
            expert_p += de
            gather_s += dg
            reduce_s += dr
            units += 1
            f_tp += on_f[0]
            f_cp += on_f[1]
            f_ep += on_f[2]
            i_tp += on_i[0]
            i_cp += on_i[1]
            i_ep += on_i[2]
            w_tp += on_w[0]
            c_tp += on_both[0]
            c_cp += on_both[1]
            c_ep += on_both[2]
            if gathered and cp > 1:
                # the whole sequence's K/V gathered inside one attention, and in its backward
                # their gradients too before the reduce-scatter
                transient = max(transient, 2 * kv_bytes)
        sc = {"F": {"tp": f_tp, "cp": f_cp, "ep": f_ep}, "I": {"tp": i_tp, "cp": i_cp, "ep": i_ep},
              "W": {"tp": w_tp, "cp": 0.0, "ep": 0.0}}
        start += count
        if stage == 0:
            emb_p = model.embedding_params(t) / t
            dense_p += emb_p
            a_bytes += embedding_activations(model, par)
            f += emb_f + emb_comm["F"]
            i += emb_i + emb_comm["I"]
            c_tp += _add_tp(sc, emb_comm)
            gather_s += zero_gather(emb_p, 0.0)
            reduce_s += zero_reduce(emb_p, 0.0)
            units += 1
        if stage == n - 1:
            head_p = model.head_params(t)
            if model.tied_embeddings and n > 1:
                head_p += model.padded_vocab(t) * model.hidden    # the output layer's copy
            dense_p += head_p / t
            f += head_f + head_comm["F"]
            i += head_i + head_comm["I"]
            w += head_w + head_comm["W"]
            c_tp += _add_tp(sc, head_comm)
            gather_s += zero_gather(head_p / t, 0.0)
            reduce_s += zero_reduce(head_p / t, 0.0)
            units += 1
            a_bytes += head_activations(model, par)
            w_bytes += e * b * (s / cp) * model.hidden / sp       # the head's input, for W
            if model.mtp_layers:
                # multi-token prediction: each module's MoE layer, its 2h -> h projection
                # (a GEMM as the layer's) and a second pass through the output layer
                k = kinds[model.is_moe]
                proj = 2 * b * (s / cp) * 2 * model.hidden * model.hidden / t / (
                    hw.peak_flops * hw.gemm_efficiency(b * s / cp, model.hidden / t,
                                                       2 * model.hidden))
                mp = model.mtp_params()
                for _ in range(model.mtp_layers):
                    f += k["F"] + head_f + proj
                    i += k["I"] + head_i + proj
                    w += k["W"] + head_w + proj
                    a_bytes += layer_activations(model, par, model.is_moe).total + \
                        head_activations(model, par)
                    dense_p += (mp["dense"] + 0.0) / t
                    expert_p += mp["expert"] / (t * par.ep)
                    gather_s += zero_gather(mp["dense"] / t, mp["expert"] / (t * par.ep))
                    reduce_s += zero_reduce(mp["dense"] / t, mp["expert"] / (t * par.ep))
                    units += 1
        fwd.append(f)
        inp.append(i)
        wgt.append(w)
        unshard_st.append(gather_s)
        units_st.append(float(max(units, 1)))
        if megatron_reduce:
            # each buffer (dense, experts) cut into its buckets, a reduce-scatter each
            first = stage == 0
            u_d = megatron_buckets(dense_p, par.dp, first_chunk=first,
                                   overlap_grad_reduce=par.overlap_grad_reduce)
            u_e = megatron_buckets(expert_p, par.dp, first_chunk=first,
                                   overlap_grad_reduce=par.overlap_grad_reduce) if expert_p else 0
            reduce_s = u_d * zero_reduce(dense_p / u_d, 0.0) + (
                u_e * zero_reduce(0.0, expert_p / u_e) if u_e else 0.0)
            reduce_units_st.append(float(u_d + u_e))
        else:
            reduce_units_st.append(units_st[-1] if par.overlap_grad_reduce else 1.0)
        reduce_st.append(reduce_s)
        act.append(a_bytes)
        wfrac.append(min(1.0, w_bytes / a_bytes) if a_bytes > 0 else 0.0)
        params_st.append({"dense": dense_p, "expert": expert_p})
        mem_st.append(param_bytes(par.precision, par.zero, dense_p, expert_p, d, d_exp,
                                  per_param=bytes_per_param(par), grads_sharded=per_mb))
        largest = max(kinds[m]["params"] for m in set(pattern[start - count:start])) if count else 0.0
        if par.zero == 3:
            # two layers gathered at a time (the one computing, the next prefetched), their
            # weights and, reduced once a microbatch, their gradients before the reduce-scatter
            # (once a step they accumulate in the whole buffer, counted as gradients)
            transient += 2 * largest * (wbytes + (gbytes if per_mb else 0))
        elif per_mb:
            # ZeRO-2 reducing once a microbatch: one bucket (a layer's gradients) filling
            transient += largest * gbytes
        buffers_stage.append(transient)
        stage_comm.append(sc)
    comm = {"tp": c_tp, "cp": c_cp, "ep": c_ep}

    schedule_stages = rank_parts(plan, n)
    rank_buffers = [max((buffers_stage[st] for st in sts), default=0.0) for sts in schedule_stages]
    holders = Counter(st for sts in schedule_stages for st in sts)
    tail: list[RankTail] = []
    for sts in schedule_stages:
        dense = sum(params_st[st]["dense"] for st in sts)
        expert = sum(params_st[st]["expert"] for st in sts)
        if par.zero == 0:
            comm_s = coll.all_reduce(gbytes * dense, d, links["dp"]) + \
                coll.all_reduce(gbytes * expert, d_exp, links["edp"])
            gather = 0.0
        else:
            # ZeRO-1: one reduce-scatter of the whole buffer in the tail; ZeRO-2/3 reduce in
            # the program's REDUCE_GRAD actions (once a step or once a microbatch), not here
            comm_s = (coll.reduce_scatter(gbytes * dense, d, links["dp"])
                      + coll.reduce_scatter(gbytes * expert, d_exp, links["edp"])
                      if par.zero == 1 else 0.0)
            gather = 0.0 if par.zero == 3 else (coll.all_gather(wbytes * dense, d, links["dp"])
                                                + coll.all_gather(wbytes * expert, d_exp, links["edp"]))
        window_b = sum(inp[st] + wgt[st] for st in sts)
        window_f = sum(fwd[st] for st in sts)
        total = dense + expert
        if par.overlap_grad_reduce:
            # the rank's last backward is its first part's: the last bucket of that part's
            # buffer is what no backward is left to hide (Megatron buckets only the first
            # rank's first part: elsewhere the part is one bucket, megatron_buckets)
            first = min(sts) if sts else 0
            part = params_st[first]["dense"] + params_st[first]["expert"] if sts else total
            last = part / megatron_buckets(part, par.dp, first_chunk=first == 0)
            last_bucket = comm_s * min(1.0, last / total) if total else 0.0
            # all but the last bucket under the backward, which they slow (pipesim.plan.overlap)
            exposed = last_bucket + added(comm_s - last_bucket, window_b, u_dp)
        else:
            exposed = comm_s
        exposed += added(gather, window_f, u_dp) if par.overlap_param_gather else gather
        # a part held by two ranks (dualpipe's copies): its gradients are summed over the
        # pair (pipeexec.training.tied), after the backward, exposed
        copied = [st for st in sts if holders[st] > 1]
        tied_s = coll.all_reduce(gbytes * sum(params_st[st]["dense"] + params_st[st]["expert"]
                                              for st in copied), 2, links["pp"]) if copied else 0.0
        exposed += tied_s
        updated = dense / (d if par.zero >= 1 else 1) + expert / (d_exp if par.zero >= 1 else 1)
        tail.append(RankTail(dp_comm=comm_s + gather, dp_exposed=exposed, tied_comm=tied_s,
                             optimizer=OPTIMIZER_BYTES * updated / hw.hbm_bandwidth))

    dp_link = links["dp"]
    dp_ar = dp_link.figure("all_reduce", d)     # the engine's own tail is an all-reduce
    pp_link = links["pp"]
    stage_static = [sum(m.values()) for m in mem_st]
    # ZeRO-2/3, timed on each rank's lane from the program's actions (pipesim.sim.dataflow):
    # gathered a layer at a time, the next prefetched under the computation (FSDP's, Megatron's);
    # the gradients reduced a unit at a time as the backward makes them (with
    # overlap_grad_reduce; else once it ends), the step's end waiting for them once a step
    # (Megatron's finalize_model_grads), each backward's end once a microbatch (DeepSpeed's
    # epilogue, FSDP's post-backward callback)
    sharding = dict(unshard=unshard_st, reduce_grad=reduce_st, overlap_sharding=1.0,
                    overlap_reduce_grad=0.0 if per_mb else 1.0, unshard_units=units_st,
                    reduce_grad_units=reduce_units_st) if par.zero >= 2 else {}
    costs = CostModel(
        forward=fwd, backward=[x + y for x, y in zip(inp, wgt)], backward_input=inp,
        backward_weight=wgt, p2p_latency=pp_link.latency, p2p_bandwidth=pp_link.bandwidth,
        p2p_bytes=act_bytes / sp, activation_bytes=act, weight_grad_fraction=wfrac,
        static_bytes=rank_buffers, stage_static_bytes=stage_static,
        grad_bytes=[gbytes * (p["dense"] + p["expert"]) for p in params_st],
        optimizer=[OPTIMIZER_BYTES * (p["dense"] / (d if par.zero >= 1 else 1)
                                      + p["expert"] / (d_exp if par.zero >= 1 else 1)) / hw.hbm_bandwidth
                   for p in params_st],
        dp_latency=dp_ar[0], dp_bandwidth=dp_ar[1],
        **sharding,
    )
    gbs = par.gbs
    # causal attention with flash kernels computes half the scores: count what runs, as
    # Megatron's num_floating_point_operations does, so MFU cannot exceed what executes
    mflops = model_flops(model, gbs, tp=t, causal=par.flash_attention)
    per_stage_rec = par.recompute_layers
    if par.recompute == "full" and per_stage_rec is not None:
        # recomputed layers: the first recompute_layers of each stage
        extra = 0.0
        start = 0
        for count in layers:
            for moe in pattern[start:start + min(count, per_stage_rec)]:
                extra += layer_flops(model, gbs, moe=moe, causal=par.flash_attention).forward
            start += count
    else:
        extra = recompute_flops(model, gbs, par.recompute, flash=par.flash_attention,
                                causal=par.flash_attention) \
            if "core_attn" in par.recomputed_modules or par.recompute != "selective" else 0.0
        if par.recompute == "selective":
            # the modules' forwards again: a microbatch's FLOPs on one rank, over every rank of
            # its tensor x context group, each layer, every microbatch
            extra += sum(kinds[moe]["rec_flops"] for moe in pattern) * gbs / b
    return PlanCosts(costs=costs, stage_layers=layers, efficiency=eff, links=links,
                     stage_params=params_st, stage_memory=mem_st, rank_buffers=rank_buffers,
                     tail=tail, comm=comm, stage_comm=stage_comm, model_flops=mflops, hardware_flops=mflops + extra,
                     calibration=hw.calibration if per_op else "constant")


def _add_tp(stage_comm: dict[str, dict[str, float]], comm: dict[str, float]) -> float:
    """Add a piece's tp collective seconds per pass (F, I, W) to its stage's; their sum."""
    for pass_, seconds in comm.items():
        stage_comm[pass_]["tp"] += seconds
    return sum(comm.values())


def rank_parts(plan, n: int) -> list[list[int]]:
    """Model parts (the ``n`` stages the costs are derived for) of each pipeline rank, by the
    schedule's placement (:func:`pipesim.schedule.registry.schedule_rank_parts`, no schedule
    built); a rank holding a copy of a part (dualpipe) lists the part again, so its weights,
    gradients and data-parallel traffic count twice."""
    par = plan.parallelism
    if isinstance(plan.schedule, Schedule):
        s = plan.schedule
        return [[s.stage_part(x) for x in s.rank_stages(r)] for r in range(par.pp)]
    try:
        return [list(held) for held in schedule_rank_parts(plan.schedule_name, par.pp, par.vpp)]
    except ScheduleError:           # not a registered schedule: one stage a rank, looped
        return [list(held) for held in placed_parts(LOOPED, par.pp, n // par.pp)]


