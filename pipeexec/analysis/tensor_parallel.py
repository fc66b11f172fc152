"""Predicting a tensor-parallel run from a run at another tp: measured compute, carried by the
plan's per-operator model, plus tp's collectives priced from a measured collective benchmark.

A calibration run's per-stage costs hold its compute (and, at tp > 1, its tp collectives). For
a run at tp', each of F, B, I and W of each stage becomes

    measured(tp) * compute(tp') / compute(tp) + collectives(tp')

(activation and message bytes scale as the plan's bytes at the two tps), where ``compute`` is
the plan's time with tp's links made free (the per-operator rooflines of
`pipesim.plan.operators` on the hardware, at the plan's sequence parallelism) and
``collectives`` the plan's time less that: tp's all-reduces (or, with sequence parallelism,
all-gathers and reduce-scatters) at the figures the hardware file holds for each collective
and group size. On this machine those come from ``pipeexec calibrate-hardware``'s gloo
benchmark (`pipeexec.measuring.collectives`), so no communication figure is a guess. The
ratio keeps what the measured run knows (its CPU share, the machine's real speed) and takes
from the plan only how compute divides over tp. Torch-free.
"""
from __future__ import annotations

from typing import Any

OPS = ("forward", "backward", "backward_input", "backward_weight")
FREE = 1e30        # bytes/s: a tp link that costs nothing


def _stage_costs(plan: Any, hardware: Any, free: bool) -> Any:
    cluster = plan.cluster.with_(hardware=hardware)
    if free:
        cluster = cluster.with_(intra_bandwidth=FREE, intra_latency=0.0, inter_bandwidth=FREE,
                                inter_latency=0.0)
    return plan.with_(cluster=cluster).derive().costs


def carry_to_tp(costs: Any, source_plan: Any, target_plan: Any, hardware: Any) -> tuple[Any, dict]:
    """``costs`` (a calibrated `pipesim.CostModel` for the target's stages, measured at
    ``source_plan``'s tp) carried to ``target_plan``'s tp on ``hardware``; returns the costs and
    a summary (the compute ratio and collective seconds per op and stage)."""
    n = len(target_plan.stage_layers())
    if len(source_plan.stage_layers()) != n:
        raise ValueError(f"carry_to_tp: the calibration is for {len(source_plan.stage_layers())} "
                         f"stages, the target has {n}")
    src_free = _stage_costs(source_plan, hardware, free=True)
    src_real = _stage_costs(source_plan, hardware, free=False)
    tgt_free = _stage_costs(target_plan, hardware, free=True)
    tgt_real = _stage_costs(target_plan, hardware, free=False)
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
    return costs.with_(**changes), summary


def tp_note(source_tp: int, target_tp: int, hardware_name: str, summary: dict) -> str:
    f = summary.get("forward", {})
    ratio = ", ".join(f"{x:.2f}" for x in f.get("compute_ratio", []))
    coll = ", ".join(f"{x * 1e3:.2f}" for x in f.get("collective_s", []))
    return (f"carried from tp {source_tp} to tp {target_tp}: each stage's F compute x [{ratio}] "
            f"(the plan's per-operator model) plus tp collectives [{coll}] ms per F, priced "
            f"from {hardware_name}'s measured collective figures")


__all__ = ["carry_to_tp", "tp_note"]
