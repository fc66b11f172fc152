"""pipesim's predicted iteration times beside Korthikanti et al. 2022 (Table 3 configs, Table 5).

"Reducing Activation Recomputation in Large Transformer Models" (Korthikanti et al., 2022):
Table 3 gives the configurations (attention heads, hidden, layers, TP, PP, GPUs, global batch,
micro batch), all on A100 80GB (Selene: 8 GPUs a node, 8 HDR 200 Gb/s NICs), s = 2048,
V = 51200, no data parallelism, the interleaved schedule with 3 chunks per rank for 175B and
530B; Table 5 the measured iteration times with full recomputation (TP only) and with
sequence parallelism + selective recomputation ("present work").

    python3 benchmarks/plan_vs_published.py          # predict with the stated A100 model
    python3 benchmarks/plan_vs_published.py --fit    # refit e_max, w_half and print them
"""
from __future__ import annotations

import argparse
import time

import pipesim
from pipesim.plan.efficiency import A100_FIT, Efficiency
from pipesim.plan.model import ModelSpec

# Table 3: name, heads, hidden, layers, tp, pp, gpus, global batch, micro batch, vpp
TABLE3 = [
    ("22B", 64, 6144, 48, 8, 1, 8, 4, 4, 1),
    ("175B", 96, 12288, 96, 8, 8, 64, 64, 1, 3),
    ("530B", 128, 20480, 105, 8, 35, 280, 280, 1, 3),
    ("1T", 160, 25600, 128, 8, 64, 512, 512, 1, 1),
]
# Table 5: iteration time (s): (full recompute, SP + selective)
TABLE5 = {"22B": (1.42, 1.10), "175B": (18.13, 13.75), "530B": (49.05, 37.83),
          "1T": (94.42, 71.49)}


def plans(efficiency: float | None = None):
    """The eight (name, method, plan, published seconds)."""
    out = []
    for name, heads, hidden, layers, tp, pp, gpus, gbs, mbs, vpp in TABLE3:
        model = ModelSpec(f"gpt-{name}", layers, hidden, heads, 2048, 51200)
        for method, sp, rec, published in (("full", False, "full", TABLE5[name][0]),
                                           ("sp+selective", True, "selective", TABLE5[name][1])):
            plan = pipesim.Plan.create(
                model, "A100", schedule="interleaved" if vpp > 1 else "1f1b", tp=tp, pp=pp,
                vpp=vpp, dp=1, micro_batch_size=mbs, global_batch_size=gbs,
                sequence_parallel=sp, recompute=rec, flash_attention=False,
                efficiency=efficiency)
            assert plan.world_size == gpus, (name, plan.world_size, gpus)
            out.append((name, method, plan, published))
    return out


def predict(model: Efficiency | None = None):
    """Predicted rows: with ``model`` the old one-curve model (a constant efficiency per run),
    by default the per-operator model (pipesim.plan.operators) with A100's fitted figures."""
    rows = []
    for name, method, plan, published in plans():
        if model is not None:
            plan = plan.with_(efficiency=model(plan.model.hidden / plan.parallelism.tp))
        r = pipesim.simulate(plan)
        rows.append((name, method, published, r.step_time, r.mfu, r.hfu))
    return rows


def fit() -> Efficiency:
    """Fit (e_max, w_half) minimising the largest relative error over the eight runs.

    Each run's step time is affine in 1/efficiency, T = X / e + Y (compute scales, the
    communication does not), as long as the critical path does not change; two simulations
    per run give X and Y; a grid search then fits the curve, and :func:`predict` checks it.
    """
    import numpy as np

    xs, ys, ws, pub = [], [], [], []
    for name, method, plan, published in plans():
        t1 = pipesim.simulate(plan.with_(efficiency=1.0)).step_time
        t2 = pipesim.simulate(plan.with_(efficiency=0.5)).step_time
        xs.append(t2 - t1)
        ys.append(2 * t1 - t2)
        ws.append(plan.model.hidden / plan.parallelism.tp)
        pub.append(published)
    xs, ys, ws, pub = map(np.asarray, (xs, ys, ws, pub))
    best = (np.inf, None)
    for w_half in np.arange(0.0, 3001.0, 10.0):
        shape = ws / (ws + w_half)
        for e_max in np.arange(0.30, 1.0001, 0.0025):
            err = np.max(np.abs((xs / (e_max * shape) + ys) / pub - 1))
            if err < best[0]:
                best = (err, Efficiency(round(float(e_max), 4), float(w_half)))
    return best[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true", help="refit the A100 efficiency curve first")
    args = ap.parse_args()
    model = None
    if args.fit:
        t0 = time.perf_counter()
        model = fit()
        print(f"fitted in {time.perf_counter() - t0:.1f} s: e_max = {model.e_max}, "
              f"w_half = {model.w_half}")
    print("per-operator model, A100's fitted figures (pipesim.hardware)" if model is None else
          f"A100 efficiency(w = hidden/tp) = {model.e_max} * w / (w + {model.w_half})")
    print(f"{'model':>5} {'method':>13} {'published s':>11} {'pipesim s':>9} {'error':>7} "
          f"{'MFU':>6} {'HFU':>6}")
    worst = 0.0
    for name, method, published, predicted, mfu, hfu in predict(model):
        err = predicted / published - 1
        worst = max(worst, abs(err))
        print(f"{name:>5} {method:>13} {published:>11.2f} {predicted:>9.2f} {err:>+7.1%} "
              f"{mfu:>6.1%} {hfu:>6.1%}")
    print(f"largest error {worst:.1%}")


if __name__ == "__main__":
    main()
