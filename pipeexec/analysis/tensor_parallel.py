"""Predicting a run from a run at another tp, cp or ep: measured compute, carried by the
plan's per-operator model, plus the collectives inside the layers priced from a measured
collective benchmark.

A calibration run's per-stage costs hold its compute (and its tp / cp / ep collectives). For a
run at another layout, each of F, B, I and W of each stage becomes

    measured(source) * compute(target) / compute(source) + collectives(target)

(activation and message bytes scale as the plan's bytes at the two layouts), where ``compute``
is the plan's time with every link made free (the per-operator rooflines of
`pipesim.plan.operators` on the hardware) and ``collectives`` the plan's time less that: tp's
all-reduces (or, with sequence parallelism, all-gathers and reduce-scatters), cp's K/V
all-gathers and dK/dV reduce-scatters, ep's dispatch and combine all-to-alls, each at the
figure the hardware file holds for that collective and group size. Both plans price cp as
pipeexec runs it (`EXECUTOR_CP_COMM`: all-gather, exposed, the attention recomputed in the
backward). On this machine the figures come from ``pipeexec calibrate-hardware``'s gloo
benchmark (`pipeexec.measuring.collectives`), so no communication figure is a guess. The
ratio keeps what the measured run knows (its CPU share, the machine's real speed) and takes
from the plan only how compute divides over the layout. The summary says, per group, the
collective seconds put in (`pipesim.plan.derive.PlanCosts.stage_comm`). Torch-free.
"""
from __future__ import annotations

from typing import Any

OPS = ("forward", "backward", "backward_input", "backward_weight")
FREE = 1e30        # bytes/s: a link that costs nothing
GROUPS = ("tp", "cp", "ep")
EXECUTOR_CP_COMM = "all_gather"     # pipeexec.parallel.context: K/V all-gathered, not a ring
# each op's passes in PlanCosts.stage_comm (B is I and W; W's collective: sequence
# parallelism's input gathered again for the weight gradient)
_PASSES = {"forward": ("F",), "backward": ("I", "W"), "backward_input": ("I",),
           "backward_weight": ("W",)}


def as_executed(plan: Any) -> Any:
    """``plan`` priced as pipeexec runs it: context parallelism by all-gather."""
    return plan.with_(cp_comm=EXECUTOR_CP_COMM)


def _derived(plan: Any, hardware: Any, free: bool) -> Any:
    cluster = plan.cluster.with_(hardware=hardware)
    if free:
        cluster = cluster.with_(intra_bandwidth=FREE, intra_latency=0.0, inter_bandwidth=FREE,
                                inter_latency=0.0)
    return plan.with_(cluster=cluster).derive()


def _stage_costs(plan: Any, hardware: Any, free: bool) -> Any:
    return _derived(plan, hardware, free).costs


def group_collectives(derived: Any) -> dict[str, dict[str, list[float]]]:
    """Per group (tp, cp, ep), per op, per stage: the collective seconds of one microbatch
    inside the layers (`PlanCosts.stage_comm`)."""
    return {g: {op: [sum(sc[p][g] for p in passes) for sc in derived.stage_comm]
                for op, passes in _PASSES.items()} for g in GROUPS}


def carry_to_layout(costs: Any, source_plan: Any, target_plan: Any, hardware: Any
                    ) -> tuple[Any, dict]:
    """``costs`` (a calibrated `pipesim.CostModel` for the target's stages, measured at
    ``source_plan``'s tp / cp / ep) carried to ``target_plan``'s on ``hardware``; returns the
    costs and a summary: per op the compute ratio and collective seconds per stage, and under
    ``"collectives"`` the target's per group (`group_collectives`)."""
    n = len(target_plan.stage_layers())
    if len(source_plan.stage_layers()) != n:
        raise ValueError(f"carry_to_layout: the calibration is for "
                         f"{len(source_plan.stage_layers())} stages, the target has {n}")
    src_free = _stage_costs(source_plan, hardware, free=True)
    src_real = _stage_costs(source_plan, hardware, free=False)
    tgt_free = _stage_costs(target_plan, hardware, free=True)
    tgt_derived = _derived(target_plan, hardware, free=False)
    tgt_real = tgt_derived.costs
    changes: dict[str, list[float]] = {}
    summary: dict[str, dict[str, list[float]]] = {}
    for op in OPS:
        if getattr(costs, op) is None:
            continue
        measured = costs.stage_values(op, n)
        sf, sr = src_free.stage_values(op, n), src_real.stage_values(op, n)
        tf, tr = tgt_free.stage_values(op, n), tgt_real.stage_values(op, n)
        ratio = [t / s if s > 0 else 1.0 for t, s in zip(tf, sf)]
        coll = [max(0.0, r - f) for r, f in zip(tr, tf)]
        # the calibration run's own collectives (tp > 1) are taken out before carrying
        own = [max(0.0, r - f) for r, f in zip(sr, sf)]
        changes[op] = [max(0.0, m - o) * q + c for m, o, q, c in zip(measured, own, ratio, coll)]
        summary[op] = {"compute_ratio": ratio, "collective_s": coll}
    # bytes: what a stage keeps and sends scale as the plan's bytes at the two tps
    for name in ("activation_bytes", "p2p_bytes"):
        measured = costs.stage_values(name, n)
        src, tgt = src_real.stage_values(name, n), tgt_real.stage_values(name, n)
        changes[name] = [m * (t / s) if s > 0 else m for m, s, t in zip(measured, src, tgt)]
    summary["collectives"] = group_collectives(tgt_derived)
    return costs.with_(**changes), summary


def layout_name(par: Any) -> str:
    """``tp 2 (sp) cp 2 ep 1``: the sizes a carry changes."""
    return (f"tp {par.tp}{' (sp)' if par.sequence_parallel and par.tp > 1 else ''} "
            f"cp {par.cp} ep {par.ep}")


def layout_note(source: Any, target: Any, hardware_name: str, summary: dict) -> str:
    """What a carry from parallelism ``source`` to ``target`` did, in words."""
    f = summary.get("forward", {})
    ratio = ", ".join(f"{x:.2f}" for x in f.get("compute_ratio", []))
    per_group = summary.get("collectives", {})
    groups = "; ".join(
        f"{g} [{', '.join(f'{x * 1e3:.2f}' for x in per_group[g]['forward'])}] F, "
        f"[{', '.join(f'{x * 1e3:.2f}' for x in per_group[g]['backward_input'])}] I"
        for g in GROUPS if g in per_group and any(per_group[g]["forward"] + per_group[g]["backward_input"]))
    return (f"carried from {layout_name(source)} to {layout_name(target)}: each stage's F "
            f"compute x [{ratio}] (the plan's per-operator model) plus the layers' collectives "
            f"in ms per microbatch ({groups or 'none'}), priced from {hardware_name}'s measured "
            "collective figures")


__all__ = ["EXECUTOR_CP_COMM", "as_executed", "carry_to_layout", "group_collectives", "layout_name",
           "layout_note"]
