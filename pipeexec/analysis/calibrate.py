"""From a measured run to a `CostModel` that predicts runs of any schedule and partition.

Time: per-stage means of F, B, I and W over every profiled step and microbatch, and a p2p
line fitted through the sends whose arrival was seen (``arrival_observed``: the receiver was
waiting), each timed from when both sides had posted (``link_start``) to the arrival; all
through ``fit_costs``.

ZeRO-2/3 (a run whose program holds UNSHARD / RESHARD / REDUCE_GRAD): ``unshard`` and
``reduce_grad`` per stage are the means of its UNSHARD and REDUCE_GRAD rows, run as the
executor runs them (blocking: ``overlap_sharding`` 0); re-partitioned per layer kind, a
collective per bucket and a bucket per layer.

Memory (the activation model of `pipesim.sim.memory`): for each (stage, microbatch) the bytes its
forward leaves held, i.e. the meter's growth over RECV_F + F + SEND_F of that pair (input
buffer, saved tensors, output while not yet sent); ``activation_bytes`` is the per-stage mean.
``weight_grad_fraction`` comes from the change over RECV_B + I + SEND_B. In this executor
I frees only what the graph above W's join nodes saved (on the head: the loss computation's
tensors; it keeps the rest, ``retain_graph``, for W) and adds the gradients W will need (and,
on the first stage, the output gradient W's full backward uses), so a block's pair holds a
little *more* after I than after F. The model cannot add memory at I: the fraction is then 1
and the growth is left out (adding it to ``activation_bytes`` instead would charge it
from the F on, far too early on stages whose F runs long before its I, as ZB-V's first stage).
A run without I/W rows gets its I and W from the split probe (`probed_split`): each stage's B
times the I/B and W/B ratios timed on that stage after the profiled steps, and its fraction
from the bytes the probe saw I release (1 where it saw nothing released, as on a block; the
head's I releases the loss computation's saved tensors, which W does not need).

Another partition: costs of a stage are the sums of its layers' costs. When the target layout
cuts the layers differently (another vpp, pp or boundaries), each field is solved per layer
kind (embedding, block, head: layers of one kind cost the same) by non-negative least squares
over the source stages, then summed over the target's stages. The result says when the source
stages could not separate the kinds (``underdetermined``).

Per-action cost: a computation also costs a fixed amount that does not scale with its layers.
Re-partitioned as if it were per layer, it is divided among the target's stages, while a layout
with more stages (another vpp) runs proportionally *more* actions, each paying it: a 1f1b run
(vpp=1) then predicts interleaved (vpp=2) far too short at small model sizes. It has two parts.
The executor's work before the computation proper (posting sends and receives, bookkeeping) is
measured: ``compute_start - start`` of each computation, by construction independent of the
layers (`action_overhead`). The computation's own fixed cost
(Python dispatch, autograd bookkeeping, small-kernel overheads) is not measured apart: it is
fitted jointly with the kinds when the source stages' compositions identify it (the matrix
[1 | layer counts] has full column rank: stages with different numbers of layers), else left in
the per-layer costs (e.g. pp stages of equal size: a constant is indistinguishable from a
layer's share). Every target stage pays both once (``Calibration.per_action``: how the term was
obtained).

The embedding and the head each sit on one stage next to blocks, so solved from the stages'
sums their costs are small differences of large numbers (stage 0 less a block's share), and
noise in either sum lands on them whole. Where the run timed them alone
(`pipeexec.measuring.probe.probe_layers`: each as a share of its stage's time, both timed in
the same repeat), ``pinned_layers`` fixes them at that share of their stage's fitted cost and
the solve fits only the blocks and the per-action term (``Calibration.pinned``). A layer timed
alone was an action of its own, so its pinned cost holds the computation's fixed cost once:
a stage pays that cost once less for each pinned layer it holds. A stage of the embedding or
the head alone thus costs its timed layer and the executor's measured work, never the fitted
term, which, as a difference of the stages' large sums, can come out at several times such a
stage's whole cost on a loaded machine; and the fitted term is bounded by what the costliest
layer timed alone took in all, since that action paid it.
"""
from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from pipesim import CostModel
from pipesim.sim.calibrate import fit_costs

from .measured_run import MeasuredRun
from .run_plan import Layout

if TYPE_CHECKING:
    import pandas as pd

_TIME_FIELDS = (("F", "forward"), ("B", "backward"), ("I", "backward_input"),
                ("W", "backward_weight"))
# How pipeexec runs ZeRO's UNSHARD / REDUCE_GRAD (`CostModel.overlap_sharding`): in their place
# in the program, the rank waiting for each collective (its wait is on the compute stream), no
# prefetch; the measured trace times them so (`measured_run.build_trace`).
EXECUTOR_SHARDING_OVERLAP = 0.0
_SHARDING_FIELDS = ("unshard", "reduce_grad")


@dataclass
class Calibration:
    """The fitted model and how it was obtained. ``model``: "wall" (per-stage means of measured
    wall time) or "processor-sharing" (CPU work stretched by simulated core sharing on
    ``cores`` effective cores, :mod:`pipeexec.analysis.contention`)."""

    costs: CostModel
    source: dict[str, Any]
    repartitioned: bool = False
    underdetermined: list[str] = field(default_factory=list)
    per_kind: dict[str, dict[str, float]] = field(default_factory=dict)
    model: str = "wall"
    cores: float | None = None
    per_action: str = "none"
    pinned: dict[str, dict[str, float]] = field(default_factory=dict)


def calibration_trace(run: MeasuredRun, steps: Sequence[int] | None = None) -> "pd.DataFrame":
    """The run's rows of ``steps`` (default all profiled). ``fit_costs`` fits the
    p2p line on the SEND rows whose arrival was observed, timed from ``link_start``."""
    return _steps(run, steps).reset_index(drop=True)


def _steps(run: MeasuredRun, steps: Sequence[int] | None) -> "pd.DataFrame":
    if steps is None:
        return run.trace
    missing = sorted(set(steps) - set(run.steps))
    if missing:
        raise ValueError(f"calibration: step(s) {missing} were not profiled (profiled: {run.steps})")
    return run.trace[run.trace["step"].isin(list(steps))]


def stage_memory(run: MeasuredRun, steps: Sequence[int] | None = None
                 ) -> dict[str, list[float]] | None:
    """Per-stage ``activation_bytes`` and ``weight_grad_fraction`` from the meter's readings
    (None when the run has no memory readings)."""
    if not run.has_memory():
        return None
    t = _steps(run, steps)
    n = run.plan.num_stages
    delta = (t["mem_end"] - t["mem_start"]).fillna(0.0)
    ops = t["op"]
    fwd_part = ops.isin(("RECV_F", "F", "SEND_F"))
    bwd_part = ops.isin(("RECV_B", "I", "SEND_B"))
    keys = [t["step"], t["stage"], t["microbatch"]]
    fwd = delta[fwd_part].groupby([k[fwd_part] for k in keys]).sum()
    fwd_stage = fwd.groupby(level=1).mean()
    act = [max(float(fwd_stage.get(s, 0.0)), 0.0) for s in range(n)]
    # pipeexec's I frees nothing (backward.py keeps the graph for W): without I/W rows to
    # measure it, the share W needs is all of it.
    frac = [1.0] * n
    if (ops == "I").any():
        bwd = delta[bwd_part].groupby([k[bwd_part] for k in keys]).sum()
        bwd_stage = bwd.groupby(level=1).mean()
        for s in range(n):
            d = float(bwd_stage.get(s, 0.0))
            if act[s] > 0 and d < 0:
                frac[s] = min(max(1.0 + d / act[s], 0.0), 1.0)
    return {"activation_bytes": act, "weight_grad_fraction": frac}


def fit_run(run: MeasuredRun, steps: Sequence[int] | None = None) -> CostModel:
    """Per-stage costs of the run's own layout (time and memory), from ``steps`` (default:
    every profiled step); ZeRO-2/3's ``unshard`` / ``reduce_grad`` from its sharding rows
    (`pipesim.sim.calibrate.fit_costs`: their per-stage means), run as the executor runs
    them (`EXECUTOR_SHARDING_OVERLAP`)."""
    n = run.plan.num_stages
    memory = stage_memory(run, steps) or {}
    return fit_costs(calibration_trace(run, steps), num_stages=n,
                     stage_parts=run.plan.schedule.stage_parts,
                     overlap_sharding=EXECUTOR_SHARDING_OVERLAP, **memory)


def has_cpu_times(run: MeasuredRun) -> bool:
    """Whether the run recorded CPU work per computation (CPU runs do)."""
    t = run.trace
    return "cpu" in t.columns and bool(np.isfinite(t.loc[t["kind"] == "compute", "cpu"]).all())


def fit_work(run: MeasuredRun, steps: Sequence[int] | None = None) -> CostModel:
    """Like `fit_run`, with each computation's CPU work in place of its wall time."""
    if not has_cpu_times(run):
        raise ValueError("fit_work: the run has no CPU times per computation (GPU run?)")
    t = calibration_trace(run, steps).copy()
    compute = t["kind"] == "compute"
    t.loc[compute, "end"] = t.loc[compute, "start"] + t.loc[compute, "cpu"].clip(lower=0.0)
    n = run.plan.num_stages
    memory = stage_memory(run, steps) or {}
    return fit_costs(t, num_stages=n, stage_parts=run.plan.schedule.stage_parts,
                     overlap_sharding=EXECUTOR_SHARDING_OVERLAP, **memory)


def probed_split(costs: CostModel, run: MeasuredRun, clock: str = "wall") -> CostModel:
    """``costs`` with I and W of every stage from its B and the run's split probe
    (:mod:`pipeexec.measuring.probe`: ``B x I/B`` and ``B x W/B`` as timed on that stage), and
    the share of activations I frees (``weight_grad_fraction`` from the probe's bytes freed at
    I), when the run has no I/W of its own; unchanged otherwise. Stages without a usable probe
    keep the even split and I freeing nothing."""
    probe = run.measurement.split_probe
    if not probe or costs.backward_input is not None or costs.backward is None:
        return costs
    n = run.plan.num_stages
    b = costs.stage_values("backward", n)
    i, w = [x / 2 for x in b], [x / 2 for x in b]
    for s in range(n):
        ri, rw = probe[s].ratios(clock) if s in probe else (math.nan, math.nan)
        if math.isfinite(ri) and math.isfinite(rw):
            i[s], w[s] = b[s] * ri, b[s] * rw
    # What I releases (the probe's ``freed_at_I``): the share of each stage's activations that
    # W does not need, which a run without I could not show.
    act = costs.stage_values("activation_bytes", n)
    frac = list(costs.stage_values("weight_grad_fraction", n))
    for s in range(n):
        freed = probe[s].freed_at_I if s in probe else None
        if freed is not None and act[s] > 0:
            frac[s] = min(max(1.0 - float(freed) / act[s], 0.0), 1.0)
    return costs.with_(backward_input=i, backward_weight=w, weight_grad_fraction=frac)


def action_overhead(run: MeasuredRun, steps: Sequence[int] | None = None, *,
                    work: bool = False) -> dict[str, list[float]]:
    """Per time field, per stage: the mean of each computation's executor work before the
    computation proper (``compute_start - start``; with ``work``, no more than its CPU time).
    A per-action cost that re-partitioning must not divide by layers. Zero when the trace has
    no ``compute_start`` (older or synthetic traces)."""
    t = _steps(run, steps)
    n = run.plan.num_stages
    out: dict[str, list[float]] = {}
    if "compute_start" not in t.columns:
        return out
    rows = t[t["kind"] == "compute"]
    post = (rows["compute_start"] - rows["start"]).astype(float).fillna(0.0).clip(lower=0.0)
    if work and "cpu" in rows.columns:
        post = np.minimum(post, rows["cpu"].astype(float).fillna(0.0).clip(lower=0.0))
    frame = rows[["op", "stage"]].assign(post=post)
    frame["op"] = frame["op"].astype(str)
    means = frame.groupby(["op", "stage"])["post"].mean()
    for op, name in _TIME_FIELDS:
        if (frame["op"] == op).any():
            out[name] = [float(means.get((op, s), 0.0)) for s in range(n)]
    return out


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares by trying every support (a handful of layer kinds)."""
    k = a.shape[1]
    best, best_err = np.zeros(k), float(np.sum(b ** 2))
    for r in range(1, k + 1):
        for cols in itertools.combinations(range(k), r):
            sub = a[:, cols]
            x, *_ = np.linalg.lstsq(sub, b, rcond=None)
            if np.any(x < 0):
                continue
            err = float(np.sum((sub @ x - b) ** 2))
            if err < best_err - 1e-18 * max(1.0, best_err):
                full = np.zeros(k)
                full[list(cols)] = x
                best, best_err = full, err
    return best


def pinned_layers(costs: CostModel, run: MeasuredRun, source: Layout, clock: str = "wall"
                  ) -> dict[str, dict[str, float]]:
    """``{field: {kind: seconds}}``: the embedding's and the head's F, B, I and W, each its
    probed share (`MeasuredRun.layer_shares`) of its stage's fitted cost; a kind held by more
    than one stage (copies), or by none of the probed stages, is left to the solve."""
    n = source.num_stages
    ops = dict(_TIME_FIELDS)
    found: dict[str, dict[str, float]] = {}
    for stage, kinds in run.layer_shares(clock).items():
        if stage >= n:
            continue
        for kind, shares in kinds.items():
            if source.layer_kinds.count(kind) != 1:     # one layer of the kind: one stage
                continue
            for op, share in shares.items():
                name = ops.get(op)
                if name is None or getattr(costs, name) is None:
                    continue
                value = float(costs.stage_values(name, n)[stage])
                found.setdefault(name, {})[kind] = float(np.clip(share, 0.0, 1.0)) * value
    return found


def repartition(costs: CostModel, source: Layout, target: Layout,
                overhead: dict[str, Sequence[float]] | None = None,
                pinned: dict[str, dict[str, float]] | None = None) -> Calibration:
    """Costs of ``target``'s stages from ``costs`` fitted on ``source``'s stages.

    Time fields: ``executor + once x own + counts x per_kind``: ``executor`` the measured
    per-action work (``overhead``: per field, per source stage, `action_overhead`; else zero),
    ``own`` the computation's fixed cost, fitted jointly when the source identifies it (else
    zero), ``once`` 1 less the stage's pinned layers (each timed alone, paying ``own`` in its
    own time); the kinds in ``pinned[field]`` (seconds, `pinned_layers`) fixed, not solved.
    ``per_kind[field]["per action"]``: executor + own. Memory, and ZeRO's ``unshard`` /
    ``reduce_grad`` (a collective per bucket, a bucket per layer): per layer only."""
    if source.layer_kinds != target.layer_kinds:
        raise ValueError(f"calibration layout has {len(source.layer_kinds)} layers "
                         f"({_kinds_text(source.layer_kinds)}), the target "
                         f"{len(target.layer_kinds)} ({_kinds_text(target.layer_kinds)}): "
                         "calibrate from a run of the same model")
    kinds = sorted(set(source.layer_kinds), key=source.layer_kinds.index)
    a_src, a_dst = source.counts(kinds), target.counts(kinds)
    rank = np.linalg.matrix_rank(a_src)
    under = [] if rank >= len(kinds) else [
        f"{source.num_stages} calibration stages cannot separate the costs of "
        f"{', '.join(kinds)} (rank {rank} < {len(kinds)}); their split is a guess"]
    n_src = source.num_stages
    changes: dict[str, Any] = {}
    per_kind: dict[str, dict[str, float]] = {}
    edges: dict[str, list[int]] = {}
    with_const = np.hstack((np.ones((n_src, 1)), a_src))
    joint = np.linalg.matrix_rank(with_const) == len(kinds) + 1
    how = "fitted" if joint else ("executor" if overhead else "none")
    split = costs.backward_input is not None and costs.backward_weight is not None and n_src > 1
    for name in ("forward", "backward", "backward_input", "backward_weight", "activation_bytes"):
        if getattr(costs, name) is None:
            continue
        values = np.asarray(costs.stage_values(name, n_src), float)
        # The first stage has no input gradient: its I does nothing and its W is the whole
        # backward, whatever layers it holds. Fit the kinds' I and W on the other stages; the
        # target's first stage gets the same treatment below.
        rows = slice(1, None) if split and name in ("backward_input", "backward_weight") \
            else slice(None)
        a_fit, values = a_src[rows], values[rows]
        time = name != "activation_bytes"
        # the kinds timed alone (pinned) are taken as they are; the solve fits the others
        fixed = {kinds.index(k): v for k, v in ((pinned or {}).get(name) or {}).items()
                 if k in kinds} if time else {}
        free = [c for c in range(len(kinds)) if c not in fixed]
        x = np.zeros(len(kinds))
        for c, v in fixed.items():
            x[c] = v
        if fixed:
            values = np.clip(values - a_fit @ x, 0.0, None)
        measured = (np.asarray(overhead[name], float)[rows] if time and overhead
                    and name in overhead else None)
        # A pinned layer was timed alone, as an action of its own: its value holds the
        # computation's per-action cost once, so a stage pays that cost once less per pinned
        # layer it holds (``once``: 1 - its pinned layers), the executor's work before the
        # computation proper (``measured``) always. An embedding- or head-only stage thus
        # costs its timed layer and the executor's work, never the fitted term.
        pinned_cols = list(fixed)
        once_src = 1.0 - a_fit[:, pinned_cols].sum(axis=1)
        once_dst = 1.0 - a_dst[:, pinned_cols].sum(axis=1)
        cap = max(fixed.values()) if fixed else math.inf
        executor, own, x[free] = _fit_free(
            a_fit[:, free], values, joint and time, measured, once_src, cap)
        per_kind[name] = dict(zip(kinds, map(float, x)))
        edges[name] = [j for j in range(target.num_stages)
                       if fixed and once_dst[j] == 0 and not a_dst[j, free].any()]
        if time:
            per_kind[name]["per action"] = executor + own
            if fixed:
                per_kind[name]["executor per action"] = executor
        changes[name] = [max(float(v) + executor + own * o, 0.0) if time else float(v)
                         for v, o in zip(a_dst @ x, once_dst)]
    # A first target stage of the embedding alone, pinned in I and W: the probe timed it as a
    # first stage (I a no-op, W the whole backward), so its I and W stand as they are.
    alone = 0 in edges.get("backward_input", ()) and 0 in edges.get("backward_weight", ())
    if split and not alone:
        first_i = float(costs.stage_values("backward_input", n_src)[0])
        whole = changes["backward_input"][0] + changes["backward_weight"][0]
        changes["backward_input"][0] = first_i
        changes["backward_weight"][0] = max(whole - first_i, 0.0)
    # What I frees is per layer (the loss computation's saved tensors on the head, next to
    # nothing on a block): fit the bytes freed, ``(1 - fraction) x activation``, per kind as the
    # activations are, and turn them back into each target stage's fraction.
    act_src = np.asarray(costs.stage_values("activation_bytes", n_src), float)
    freed_src = (1.0 - np.asarray(costs.stage_values("weight_grad_fraction", n_src), float)) * act_src
    x = _nnls(a_src, freed_src) if rank >= len(kinds) else np.clip(
        np.linalg.lstsq(a_src, freed_src, rcond=None)[0], 0.0, None)
    act_dst = changes.get("activation_bytes", [0.0] * target.num_stages)
    changes["weight_grad_fraction"] = [
        float(np.clip(1.0 - fr / a, 0.0, 1.0)) if a > 0 else 1.0 for fr, a in zip(a_dst @ x, act_dst)]
    # ZeRO's collectives act on a stage's buckets, one a layer (`pipeexec.training.flat`): per
    # layer kind, as the activations (a run without them: none)
    for name in _SHARDING_FIELDS:
        values = np.asarray(costs.stage_values(name, n_src), float)
        if not values.any():
            changes[name] = 0.0
            continue
        x = _nnls(a_src, values) if rank >= len(kinds) else np.clip(
            np.linalg.lstsq(a_src, values, rcond=None)[0], 0.0, None)
        per_kind[name] = dict(zip(kinds, map(float, x)))
        changes[name] = [float(v) for v in a_dst @ x]
    # Message sizes are per stage boundary, not per layer: use their mean.
    p2p = costs.stage_values("p2p_bytes", n_src)
    sent = [b for b in p2p[:-1] if b > 0]
    changes["p2p_bytes"] = float(np.mean(sent)) if sent else 0.0
    return Calibration(costs.with_(**changes), {}, True, under, per_kind, per_action=how,
                       pinned={name: dict(v) for name, v in (pinned or {}).items()})


def _fit_free(a: np.ndarray, values: np.ndarray, joint: bool, overhead: np.ndarray | None,
              once: np.ndarray, cap: float = math.inf) -> tuple[float, float, np.ndarray]:
    """(executor seconds per action, the computation's own per-action seconds, per-kind
    seconds) solved over the stages, whose ``values`` cost ``executor + once x own + counts x
    per_kind`` (``once``: 1, less one per pinned layer the stage holds). Where the stages
    identify it (``joint`` and [once | counts] of full rank), the computation's term is fitted
    jointly with the kinds beside the executor's measured work (``overhead``'s mean, or 0), the
    two together non-negative and the term at most ``cap``: solved from the stages' large sums
    it is a difference of large numbers, and a layer timed alone (``cap``: the costliest pinned
    one) paid it in full. Otherwise the executor's measured work per stage is taken off, and
    the rest is per layer. The kinds by non-negative least squares (clipped least squares where
    the stages cannot separate them)."""
    k = a.shape[1]
    with_once = np.hstack((np.asarray(once, float).reshape(-1, 1), a))
    executor = float(np.mean(overhead)) if overhead is not None and len(overhead) else 0.0
    own = 0.0
    if joint and np.linalg.matrix_rank(with_once) == k + 1:
        # fitted as ``executor + own`` >= 0 where the stage pays ``own`` (``once``): the measured
        # work (with CPU times, its wall time at most) may overstate what an action costs
        values = values - executor * (1.0 - with_once[:, 0])
        fitted = float(_nnls(with_once, np.clip(values, 0.0, None))[0])
        own = float(np.clip(fitted, 0.0, executor + cap)) - executor
        values = np.clip(values - (executor + own) * with_once[:, 0], 0.0, None)
    elif overhead is not None:
        values = np.clip(values - overhead, 0.0, None)
    x = _nnls(a, values) if np.linalg.matrix_rank(a) >= k else np.clip(
        np.linalg.lstsq(a, values, rcond=None)[0], 0.0, None)
    return executor, own, x


def calibrate(run: MeasuredRun, target: Layout | None = None,
              steps: Sequence[int] | None = None, *, work: bool = False) -> Calibration:
    """A CostModel for ``target`` (default: the run's own layout) from a measured run's
    ``steps`` (default: all profiled). ``work``: CPU work instead of wall time (see
    `fit_work`; the caller turns it into wall time for a schedule)."""
    costs = fit_work(run, steps) if work else fit_run(run, steps)
    costs = probed_split(costs, run, clock="cpu" if work else "wall")
    plan = run.plan
    source = plan.layout
    info = {"schedule": plan.schedule_name, "pp": plan.pp, "vpp": plan.parts_per_rank,
            "microbatches": plan.microbatches, "bounds": list(source.bounds),
            "steps": list(steps) if steps is not None else run.steps}
    if target is None or target.bounds == source.bounds:
        return Calibration(costs, info)
    cal = repartition(costs, source, target, action_overhead(run, steps, work=work),
                      pinned_layers(costs, run, source, clock="cpu" if work else "wall"))
    cal.source = info
    return cal


def _kinds_text(kinds: Sequence[str]) -> str:
    out = []
    for k, group in itertools.groupby(kinds):
        n = len(list(group))
        out.append(f"{k} x{n}" if n > 1 else k)
    return ", ".join(out)


def costs_summary(costs: CostModel, num_stages: int) -> dict[str, Any]:
    """Per-stage F/B/I/W seconds, p2p line and activation bytes, JSON-ready; ZeRO's
    UNSHARD / REDUCE_GRAD seconds per stage (and whether they overlap) where they cost
    anything, so a run without them reports as before."""
    times = costs.compute_times(num_stages)
    out = {"F": times["F"], "B": times["B"], "I": times["I"], "W": times["W"],
           "p2p_latency": costs.p2p_latency,
           "p2p_bandwidth": None if math.isinf(costs.p2p_bandwidth) else costs.p2p_bandwidth,
           "activation_bytes": costs.stage_values("activation_bytes", num_stages),
           "weight_grad_fraction": costs.stage_values("weight_grad_fraction", num_stages)}
    sharding = {name: costs.stage_values(name, num_stages) for name in _SHARDING_FIELDS}
    if any(any(v) for v in sharding.values()):
        out.update(sharding, overlap_sharding=costs.overlap_sharding)
    return out
