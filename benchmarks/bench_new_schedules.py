"""The schedules the field moved to, measured side by side in one run (CPU / gloo).

1F1B, interleaved (vpp 2), ZB-H1, ZB-V (vpp 2), DualPipeV (vpp 2) and zb-auto at the ZB-1p and
ZB-2p memory limits, on the same model. As in ``bench_prediction.py``, every schedule X trains
in one job side by side with 1F1B, alternating step by step, so both meet the same machine; X
is predicted from that job's 1F1B steps alone (before and without its own timings) and from its
own profiled steps, and measured (step time and bubble_fraction over its central profiled
steps, peak activation memory: the bytes of the tensors the runtime holds).

zb-auto is searched from costs calibrated on a first 1F1B run (its per-stage F, I, W and
activation bytes, ``pipeexec.profile.calibrate``), simulated as the executor runs
(rendezvous transfers, receives one computation early), under ``p * M_B`` (ZB-1p) and
``2 p * M_B`` (ZB-2p), M_B the largest calibrated activation bytes of a stage-microbatch; the
searched schedules are written as JSON and run as schedule files.

Target (issue 16): zb-auto at the ZB-2p limit measures no slower than every hand-made schedule
of the same or lower measured peak memory; the last lines say whether this run met it. Step
times are compared as ratios to the 1F1B of the same job: the load of a shared machine moves
between jobs far more than between the alternating steps of one.

    OMP_NUM_THREADS=1 python benchmarks/bench_new_schedules.py            # pp 2
    OMP_NUM_THREADS=1 python benchmarks/bench_new_schedules.py --pp 4 --cpus-per-rank 0.5
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pipesim  # noqa: E402
from bench_prediction import model_config, paired_worker, pct  # noqa: E402
from pipeexec import launch  # noqa: E402
from pipeexec.profile import compare_runs, layout_of, predict  # noqa: E402
from pipeexec.profile.calibrate import calibrate  # noqa: E402
from pipeexec.profile.compare_cli import profiled_run  # noqa: E402
from pipeexec.profile.predict import EXECUTOR_COMM  # noqa: E402
from pipesim.schedule.io import schedule_to_json  # noqa: E402

HANDMADE = (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 2), ("dualpipev", 2))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--cpus-per-rank", type=float, default=None,
                   help="confine every rank to this many CPUs (cgroup quota)")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--steps", type=int, default=6, help="steps per run; 1.. are profiled")
    p.add_argument("--timeout", type=float, default=900.0)
    args = p.parse_args(argv)
    pp, cpus = args.pp, args.cpus_per_rank
    started = time.time()
    print(f"# CPU/gloo, {os.cpu_count()} cores, pp={pp}"
          + (f", {cpus} CPUs a rank" if cpus else "")
          + f"; GPT {args.layers}+2 layers hidden {args.hidden} seq {args.seq_len} "
          f"b {args.micro_batch_size} m {args.microbatches}", flush=True)

    # zb-auto from a first 1F1B run's calibrated costs
    first = profiled_run(model_config(args, "1f1b", pp, 1), 1, args.steps, timeout=args.timeout,
                         cpus_per_rank=cpus)
    costs = calibrate(first, steps=first.central_steps()).costs
    m_b = max(costs.stage_values("activation_bytes", pp))
    tmp = Path(tempfile.mkdtemp(prefix="zb-auto-"))
    configs = [(name, model_config(args, name, pp, vpp), None) for name, vpp in HANDMADE]
    for label, factor in (("zb-auto ZB-1p", 1), ("zb-auto ZB-2p", 2)):
        limit = factor * pp * m_b
        s = pipesim.build_schedule("zb-auto", pp=pp, microbatches=args.microbatches,
                                   costs=costs, memory_limit=limit, comm=EXECUTOR_COMM,
                                   lookahead=1)
        path = tmp / f"zb-auto-{factor}p.json"
        schedule_to_json(s, path)
        configs.append((label, model_config(args, str(path), pp, 1), limit))
    print(f"M_B = {m_b / 1e6:.2f} MB (largest calibrated activations of a stage-microbatch); "
          f"zb-auto searched under {pp} M_B and {2 * pp} M_B", flush=True)

    rows = []
    for label, cfg, limit in configs:
        calib_cfg = model_config(args, "1f1b", pp, 1)
        calib, run = launch(paired_worker, pp, ([calib_cfg, cfg], 1, args.steps),
                            timeout=args.timeout, cpus_per_rank=cpus)[0]
        predicted, _ = predict(cfg.build_schedule(), layout_of(cfg), calib)
        own = compare_runs(run).report()
        measured = own["measured_step_time"]
        paired = compare_runs(calib).report()["measured_step_time"]   # 1F1B, same job
        peak = max(v for v in own["measured_peak_memory"] if v is not None) \
            if "measured_peak_memory" in own else float("nan")
        rows.append({"schedule": label, "vpp": cfg.vpp, "measured_ms": measured * 1e3,
                     "ratio": measured / paired,
                     "cross_ms": predicted.makespan * 1e3,
                     "cross_err": (predicted.makespan - measured) / measured,
                     "own_ms": own["predicted_step_time"] * 1e3, "own_err": own["step_time_error"],
                     "bf": own["measured_bubble_fraction"], "peak_mb": peak / 1e6,
                     "limit_mb": None if limit is None else limit / 1e6,
                     "load": os.getloadavg()[0]})
        r = rows[-1]
        print(f"{label}: measured {r['measured_ms']:.0f} ms ({r['ratio']:.3f}x the job's 1F1B), "
              f"predicted from 1f1b "
              f"{r['cross_ms']:.0f} ms ({pct(r['cross_err'])}), own trace {pct(r['own_err'])}, "
              f"peak {r['peak_mb']:.2f} MB (load {r['load']:.1f})", flush=True)

    print()
    print("| schedule | vpp | measured step (ms) | / 1F1B of the same job | predicted from 1f1b "
          "(ms) | error | predicted, own trace (ms) | error | bubble_fraction measured | peak act. "
          "memory, max rank (MB) | memory limit (MB) | load avg |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        lim = "" if r["limit_mb"] is None else f"{r['limit_mb']:.2f}"
        print(f"| {r['schedule']} | {r['vpp']} | {r['measured_ms']:.0f} | {r['ratio']:.3f} | "
              f"{r['cross_ms']:.0f} | "
              f"{pct(r['cross_err'])} | {r['own_ms']:.0f} | {pct(r['own_err'])} | {r['bf']:.3f} | "
              f"{r['peak_mb']:.2f} | {lim} | {r['load']:.1f} |")
    two_p = next(r for r in rows if r["schedule"] == "zb-auto ZB-2p")
    rivals = [r for r in rows if r["limit_mb"] is None and r["peak_mb"] <= two_p["peak_mb"] * 1.001]
    # The machine's load moves between jobs: compare each schedule with the 1F1B of its own job.
    slower = [r["schedule"] for r in rivals if r["ratio"] < two_p["ratio"]]
    print(f"\ntarget: zb-auto ZB-2p ({two_p['ratio']:.3f}x its job's 1F1B, peak "
          f"{two_p['peak_mb']:.2f} MB) no slower (against its job's 1F1B) than the hand-made "
          f"schedules of the same or lower peak "
          f"({', '.join(r['schedule'] for r in rivals) or 'none'}): "
          + ("met" if not slower else f"NOT met (faster: {', '.join(slower)})"))
    print(f"{len(rows)} paired jobs and 1 calibration run in {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
