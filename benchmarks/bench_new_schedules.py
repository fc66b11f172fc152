"""The schedules the field moved to, measured side by side in one job (CPU / gloo).

1F1B, interleaved (vpp 2), ZB-H1, ZB-V (vpp 2), DualPipeV (vpp 2) and zb-auto at the ZB-1p and
ZB-2p memory limits train on the same model in ONE job, one step of each in turn
(`pipeexec.run.paired`), so every schedule meets the same machine within seconds of the
others: the load of a shared machine moves between jobs far more than between the steps of one
round. Each schedule's step time is a per-round ratio (its step over 1F1B's step of the same
round: median and interquartile range over the profiled rounds); every schedule is predicted
from the 1F1B steps alone (before and without its own timings) and from its own profiled steps,
and measured (step time and bubble_fraction over its central profiled steps, peak activation
memory: the bytes of the tensors the runtime holds).

zb-auto is searched from costs calibrated on a first 1F1B run, ranked as `pipeexec` predicts
(`pipeexec.analysis.prediction_costs`: rendezvous transfers, receives one computation early,
processor sharing where the ranks share cores), at vpp 1 and at vpp 2 (looped and V
placements), under ``p * M_B`` (ZB-1p) and ``2 p * M_B`` (ZB-2p), M_B the largest calibrated
activation bytes of a stage-microbatch at vpp 1; for each limit the search predicted fastest
(among the vpp 1 and vpp 2 ones, whose predicted peak fits) is written as JSON and run as a
schedule file. When its order is a handcrafted one's, the table says which. ``--margin``
(default 5%, about the accuracy of the own-trace predictions): zb-auto keeps the fastest
hand-made order unless a searched one is predicted faster by more than that.

Target: zb-auto at the ZB-2p limit measures no slower than every hand-made schedule
of the same or lower measured peak memory. For each such rival the last lines give the median
and interquartile range of zb-auto's step over the rival's step of the same round, and say
"met" (median <= 1), "within noise" (median > 1, the quartile range reaches 1) or "NOT met";
and whether the prediction says the same.

    OMP_NUM_THREADS=1 python benchmarks/bench_new_schedules.py            # pp 2
    OMP_NUM_THREADS=1 python benchmarks/bench_new_schedules.py --pp 4 --cpus-per-rank 0.5
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pipesim  # noqa: E402
from bench_prediction import add_model_args, model_config, pct  # noqa: E402
from pipeexec.analysis import compare_runs, layout_of, predict, prediction_costs  # noqa: E402
from pipeexec.cli.compare import profiled_run  # noqa: E402
from pipeexec.run.paired import paired_runs  # noqa: E402
from pipeexec.analysis.predict import EXECUTOR_COMM  # noqa: E402
from pipesim.zb_auto.search import handcrafted_origin  # noqa: E402
from pipesim.schedule.io import schedule_to_json  # noqa: E402

HANDMADE = (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 2), ("dualpipev", 2))
SEARCHED = (("zb-auto ZB-1p", 1), ("zb-auto ZB-2p", 2))


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    """(lower quartile, median, upper quartile)."""
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[1], q[2]


def per_round(run, ref) -> list[float]:
    """run's step over ref's step of the same round, for every profiled step both have."""
    a, b = run.makespans(), ref.makespans()
    return [a[k] / b[k] for k in sorted(a) if k in b]


def search(args, first, limit: float, pp: int):
    """The zb-auto schedule predicted fastest under ``limit`` over vpp 1 and 2 (a searched
    order only when faster by ``--margin`` than a hand-made one), and its score (from
    ``first``, the calibration run); None when nothing fits."""
    best = None
    for vpp in (1, 2):
        layout = layout_of(model_config(args, "1f1b", pp, vpp))
        cal = prediction_costs(layout, first)
        try:
            s = pipesim.build_schedule("zb-auto", pp=pp, vpp=vpp, microbatches=args.microbatches,
                                       costs=cal.costs, memory_limit=limit, comm=EXECUTOR_COMM,
                                       lookahead=1, cores=cal.cores, margin=args.margin)
        except pipesim.ScheduleError as exc:
            print(f"  vpp {vpp}: {exc}", flush=True)
            continue
        r, _ = predict(s.with_recv_lookahead(1), layout, first)
        hand = []                                   # the benchmark's hand-made ones, same vpp
        for name, v in HANDMADE:
            if v == vpp:
                h, _ = predict(model_config(args, name, pp, vpp).build_schedule(), layout, first)
                if max(h.peak_memory) <= limit * (1 + 1e-9):
                    hand.append((h.makespan, name))
        print(f"  vpp {vpp}: predicted {r.makespan * 1e3:.0f} ms, peak "
              f"{max(r.peak_memory) / 1e6:.2f} MB, {s.placement_kind} placement"
              + (f", {same}'s order" if (same := handcrafted_origin(s))
                 else "")
              + (f" (fastest hand-made of vpp {vpp} under the limit: {min(hand)[1]} "
                 f"{min(hand)[0] * 1e3:.0f} ms)" if hand else ""), flush=True)
        # across vpp too, a searched order must gain the margin over a hand-made one
        score = r.makespan * (1 + args.margin if same is None else 1.0)
        if max(r.peak_memory) <= limit * (1 + 1e-9) and (best is None or score < best[1]):
            best = (s, score)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--cpus-per-rank", type=float, default=None,
                   help="confine every rank to this many CPUs (cgroup quota)")
    add_model_args(p, steps=16)             # steps of every schedule: rounds of the job
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--margin", type=float, default=0.05,
                   help="zb-auto keeps the fastest hand-made order unless a searched one is "
                        "predicted faster by more than this fraction (0: the fastest predicted)")
    args = p.parse_args(argv)
    pp, cpus, m = args.pp, args.cpus_per_rank, args.microbatches
    started = time.time()
    print(f"# CPU/gloo, {os.cpu_count()} cores, pp={pp}"
          + (f", {cpus} CPUs a rank" if cpus else "")
          + f"; GPT {args.layers}+2 layers hidden {args.hidden} seq {args.seq_len} "
          f"b {args.micro_batch_size} m {m}; load average {os.getloadavg()[0]:.1f}", flush=True)

    # zb-auto from a first 1F1B run's calibrated costs
    first = profiled_run(model_config(args, "1f1b", pp, 1), 1, args.steps, timeout=args.timeout,
                         cpus_per_rank=cpus)
    layout1 = layout_of(model_config(args, "1f1b", pp, 1))
    m_b = max(prediction_costs(layout1, first).costs.stage_values("activation_bytes", pp))
    print(f"M_B = {m_b / 1e6:.2f} MB (largest calibrated activations of a stage-microbatch)",
          flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="zb-auto-"))
    configs = [(name, model_config(args, name, pp, vpp), None, None) for name, vpp in HANDMADE]
    for label, factor in SEARCHED:
        limit = factor * pp * m_b
        print(f"{label}: searched under {factor * pp} M_B = {limit / 1e6:.2f} MB, margin "
              f"{args.margin:.0%}", flush=True)
        found = search(args, first, limit, pp)
        if found is None:
            print(f"  {label}: nothing fits; left out", flush=True)
            continue
        path = tmp / f"zb-auto-{factor}p.json"
        schedule_to_json(found[0], path)
        configs.append((label, model_config(args, str(path), pp, found[0].vpp), limit,
                        handcrafted_origin(found[0])))

    # One job, one step of every schedule in turn
    load0 = os.getloadavg()[0]
    runs = paired_runs([c[1] for c in configs], 1, args.steps, timeout=args.timeout,
                       cpus_per_rank=cpus)
    load1 = os.getloadavg()[0]
    ref = runs[0]                                      # 1F1B (HANDMADE[0])
    rows = []
    for (label, cfg, limit, same), run in zip(configs, runs):
        predicted, _ = predict(cfg.build_schedule(), layout_of(cfg), ref)
        own = compare_runs(run).report()
        measured = own["measured_step_time"]
        lo, med, hi = quartiles(per_round(run, ref))
        peak = max(v for v in own["measured_peak_memory"] if v is not None) \
            if "measured_peak_memory" in own else float("nan")
        rows.append({"schedule": label, "vpp": cfg.plan.parallelism.vpp, "run": run, "same": same,
                     "placement": cfg.build_schedule().placement_kind,
                     "measured_ms": measured * 1e3, "ratio": (lo, med, hi),
                     "cross_ms": predicted.makespan * 1e3,
                     "cross_err": (predicted.makespan - measured) / measured,
                     "own_ms": own["predicted_step_time"] * 1e3, "own_err": own["step_time_error"],
                     "bf": own["measured_bubble_fraction"], "peak_mb": peak / 1e6,
                     "limit_mb": None if limit is None else limit / 1e6})

    print(f"\none job, {len(configs)} schedules alternating, {args.steps} steps each; load "
          f"average {load0:.1f} before, {load1:.1f} after\n")
    print("| schedule | vpp | placement | measured step (ms) | / 1F1B of the same round: median "
          "[quartiles] | predicted from 1f1b (ms) | error | predicted, own trace (ms) | error | "
          "bubble_fraction measured | peak act. memory, max rank (MB) | memory limit (MB) |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        lim = "" if r["limit_mb"] is None else f"{r['limit_mb']:.2f}"
        name = r["schedule"] + (f" (= {r['same']})" if r["same"] else "")
        lo, med, hi = r["ratio"]
        print(f"| {name} | {r['vpp']} | {r['placement']} | {r['measured_ms']:.0f} | "
              f"{med:.3f} [{lo:.3f}, {hi:.3f}] | {r['cross_ms']:.0f} | {pct(r['cross_err'])} | "
              f"{r['own_ms']:.0f} | {pct(r['own_err'])} | {r['bf']:.3f} | {r['peak_mb']:.2f} | "
              f"{lim} |")
    two_p = next((r for r in rows if r["schedule"] == "zb-auto ZB-2p"), None)
    if two_p is None:
        print("\ntarget: zb-auto ZB-2p found nothing under its limit: NOT met")
        return 0
    rivals = [r for r in rows if r["limit_mb"] is None and r["peak_mb"] <= two_p["peak_mb"] * 1.001]
    print(f"\ntarget: zb-auto ZB-2p (peak {two_p['peak_mb']:.2f} MB) no slower than each "
          "hand-made schedule of the same or lower peak, per round (zb-auto's step / the "
          "rival's step of the same round, median [quartiles]); predicted, from 1F1B's steps:")
    verdicts = []
    for r in rivals:
        lo, med, hi = quartiles(per_round(two_p["run"], r["run"]))
        verdict = "met" if med <= 1.0 else "within noise" if lo <= 1.0 else "NOT met"
        verdicts.append(verdict)
        said = "no slower" if two_p["cross_ms"] <= r["cross_ms"] * (1 + 1e-9) else "slower"
        print(f"  vs {r['schedule']} (peak {r['peak_mb']:.2f} MB): {med:.3f} [{lo:.3f}, "
              f"{hi:.3f}]: {verdict}; predicted {two_p['cross_ms']:.0f} vs {r['cross_ms']:.0f} ms "
              f"({said})")
    overall = ("met" if all(v == "met" for v in verdicts) else
               "NOT met" if "NOT met" in verdicts else "within noise")
    print(f"target: {overall} ({len(rivals)} rivals: "
          f"{', '.join(r['schedule'] for r in rivals) or 'none'})")
    print(f"1 calibration run and 1 job of {len(configs)} schedules in "
          f"{time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
