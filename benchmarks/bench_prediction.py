"""Predicted vs measured, in one run: the numbers of the README's results table.

For each pipeline size (default pp = 2 and 4; CPU, gloo, one thread per rank), and each
schedule X of gpipe, interleaved (vpp 2), zb-h1, zbv (vpp 2) and 1f1b itself:

1. one job trains 1f1b and X side by side in the same processes, alternating step by step
   (``--steps`` steps each, steps 1.. profiled), so both meet the same machine;
2. X is predicted from the 1f1b steps' trace alone (CPU work per stage, re-partitioned per
   layer kind where vpp differs, simulated with the effective cores fitted to the 1f1b steps
   shared among the ranks computing at each moment of X) and compared with X's measured mean
   step (step time and bubble_fraction averaged over its central profiled steps): the cross-schedule
   error. X = 1f1b measures the noise floor of that comparison;
3. X is also simulated with costs calibrated from its own profiled steps: does the simulator
   reproduce a run from its per-stage costs?

Why side by side: this benchmark runs on shared machines. On the 2-core VM it was written on,
two back-to-back runs of the very same 1f1b configuration differed by up to 2x in step time
(``--mode sequential`` runs schedules one after the other, each predicted from a fresh 1f1b run
made just before it, and shows that). Alternating steps puts calibration and measurement
seconds apart instead of a minute.

Prints one markdown table: step time (makespan of the pipeline part of the step), Megatron's
bubble_fraction, and per-rank peak activation memory (measured: exact bytes of the tensors the
runtime holds; predicted: pipesim's memory model with calibrated bytes), with errors, and the
machine's load average during each job. ``--out-dir`` keeps every report JSON, overlay
picture and measured trace.

Mind the machine: pp ranks share the CPU cores (``os.cpu_count()`` is printed). With more
ranks than cores, ranks time-share; calibrated costs then include the contention of the run
they came from, which differs between schedules (a schedule with more ranks computing at once
slows each computation more), and an action's duration depends on which other ranks compute
at that moment. A pipeline gives each rank its own device; for each pp above the core count
the benchmark therefore also runs with every rank confined to cores/pp CPUs by a cgroup quota
(``--confine``, `pipeexec.launching.cpu_quota`): a device per rank, emulated (slower ones). Other
processes on the machine add noise of their own.

    python benchmarks/bench_prediction.py                 # pp 2, 4, 4 confined: ~5 minutes
    python benchmarks/bench_prediction.py --pp 4 --out-dir /tmp/pred
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import pipesim
from pipeexec.config import TrainConfig
from pipeexec.launching.cpu_quota import quotas_available
from pipeexec.analysis import compare_runs, layout_of, predict
from pipeexec.cli.compare import profiled_run, write_outputs
from pipeexec.run.paired import paired_runs

SCHEDULES = (("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 2))


def add_model_args(p: argparse.ArgumentParser, steps: int) -> None:
    """The benchmarks' shared model and batch flags (the README's size by default)."""
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--layers", type=int, default=6, help="transformer blocks (+ embedding, head)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--steps", type=int, default=steps, help="steps per run; 1.. are profiled")


def model_config(args: argparse.Namespace, schedule: str, pp: int, vpp: int) -> TrainConfig:
    return TrainConfig.from_flat(schedule=schedule, pp=pp, vpp=vpp, microbatches=args.microbatches,
                                 micro_batch_size=args.micro_batch_size, layers=args.layers,
                                 hidden=args.hidden, heads=args.heads, seq_len=args.seq_len,
                                 vocab=args.vocab, steps=args.steps, backend="gloo", device="cpu",
                                 p2p_timeout=600.0, collective_timeout=900.0)


def pct(x: float) -> str:
    return f"{x:+.1%}"


def where(cpus: float | None) -> str:
    return f" ({cpus:g} CPU per rank)" if cpus else ""


def subdir(pp: int, cpus: float | None) -> str:
    """Where --out-dir keeps one (pp, CPUs per rank) group's files."""
    return f"pp{pp}" + (f"-cpus{cpus:g}" if cpus else "")


def share(cpus: float | None, pp: int) -> str:
    """The table's CPU column: ranks sharing the machine's cores, or confined to a share."""
    if cpus:
        return f"{cpus:g} (quota)"
    cores = os.cpu_count() or 1
    return f"{cores} cores shared" if pp > cores else "1 core each"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--schedules", nargs="+", default=[s for s, _ in SCHEDULES],
                   help="schedules to run (1f1b is always run first: it is the calibration)")
    add_model_args(p, steps=6)
    p.add_argument("--out-dir", default=None, help="keep reports, pictures and traces here")
    p.add_argument("--timeout", type=float, default=900.0, help="limit per run, seconds")
    p.add_argument("--confine", choices=("auto", "on", "off"), default="auto",
                   help="for each pp above the core count, also run with every rank confined "
                        "to cores/pp CPUs by a cgroup quota (a core per rank, emulated): "
                        "auto = when this machine allows it")
    p.add_argument("--mode", choices=("paired", "sequential"), default="paired",
                   help="paired: 1f1b and each schedule alternate steps in one job (default); "
                        "sequential: separate runs, each schedule predicted from a 1f1b run "
                        "made just before it")
    args = p.parse_args(argv)
    vpps = dict(SCHEDULES)
    names = ["1f1b"] + [s for s in args.schedules if s != "1f1b"]
    out = Path(args.out_dir) if args.out_dir else None
    print(f"# predicted vs measured: CPU/gloo, {os.cpu_count()} cores, "
          f"GPT {args.layers}+2 layers hidden {args.hidden} seq {args.seq_len} "
          f"b {args.micro_batch_size} m {args.microbatches}; steps 1..{args.steps - 1} profiled, "
          f"means over them compared", flush=True)
    rows, started = [], time.time()

    def record(pp, cpus, name, cfg, run, cross, calib_label):
        own = compare_runs(run)
        mine = own.report()
        if out:
            tag = name.split(" ")[0]
            write_outputs(own, report_out=str(out / subdir(pp, cpus) / f"{tag}-{len(rows)}.report.json"))
        mem_err = max(abs(e) for e in mine["peak_memory_error"] if e is not None)
        row = {"pp": pp, "cpus": cpus, "schedule": name, "vpp": cfg.plan.parallelism.vpp,
               "calib": calib_label,
               "measured_ms": mine["measured_step_time"] * 1e3,
               "self_ms": mine["predicted_step_time"] * 1e3, "self_err": mine["step_time_error"],
               "bf_meas": mine["measured_bubble_fraction"],
               "bf_steps": [run.result(s).bubble_fraction for s in run.steps],
               "bf_self": mine["predicted_bubble_fraction"], "mem_err": mem_err,
               "steps_ms": "/".join(f"{v * 1e3:.0f}" for v in mine["measured_step_times"].values()),
               "load": os.getloadavg()[0]}
        if cross is not None:
            crossed = compare_runs(run, cross[2]).report()
            row.update(cross_ms=cross[0].makespan * 1e3,
                       cross_err=(cross[0].makespan - mine["measured_step_time"]) / mine["measured_step_time"],
                       bf_cross=cross[0].bubble_fraction,
                       cross_mem_err=max(abs(e) for e in crossed["peak_memory_error"] if e is not None))
        rows.append(row)
        print(f"pp={pp}{where(cpus)} {name}: measured {row['measured_ms']:.0f} ms (steps {row['steps_ms']}; "
              f"load {row['load']:.1f}), own trace {pct(row['self_err'])}"
              + (f", from {calib_label} {pct(row['cross_err'])}" if cross else ""), flush=True)

    cores = os.cpu_count() or 1
    plan = []
    for pp in (args.pp if args.mode == "paired" else []):
        plan.append((pp, None))
        if pp > cores and args.confine != "off":
            if args.confine == "on" or quotas_available():
                plan.append((pp, cores / pp))
            else:
                print(f"pp={pp}: no rows with a core per rank (no writable cgroup CPU "
                      "controller here; --confine on to insist)", file=sys.stderr)
    for pp, cpus in plan:
        first_job = True
        for name in names[1:] + ["1f1b"]:
            vpp = vpps.get(name, 1)
            cfg = model_config(args, name, pp, vpp)
            calib_cfg = model_config(args, "1f1b", pp, 1)
            try:
                cfg.validate()
            except (ValueError, pipesim.ScheduleError) as exc:
                print(f"skip {name} pp={pp} vpp={vpp}: {exc}", file=sys.stderr)
                continue
            calib, run = paired_runs([calib_cfg, cfg], 1, args.steps, timeout=args.timeout,
                                     cpus_per_rank=cpus)
            if out:
                calib.save(out / subdir(pp, cpus) / f"1f1b-with-{name}.json")
                run.save(out / subdir(pp, cpus) / f"{name}-with-1f1b.json")
            if first_job:
                record(pp, cpus, "1f1b", calib_cfg, calib, None, "")
                first_job = False
            # The cross-schedule prediction uses only the 1f1b steps of the job.
            predicted, cal = predict(cfg.build_schedule(), layout_of(cfg), calib)
            record(pp, cpus, name if name != "1f1b" else "1f1b (2nd copy)", cfg, run,
                   (predicted, cal, calib), "1f1b steps of the same job")

    for pp in (args.pp if args.mode == "sequential" else []):
        trace_dir = out / f"pp{pp}" if out else None

        def run_1f1b(k):
            return profiled_run(model_config(args, "1f1b", pp, 1), 1, args.steps,
                                timeout=args.timeout,
                                trace_out=str(trace_dir / f"1f1b-{k}.json") if trace_dir else None)
        calib = run_1f1b(0)
        record(pp, None, "1f1b", model_config(args, "1f1b", pp, 1), calib, None, "")
        k = 0
        for name in names[1:]:
            vpp = vpps.get(name, 1)
            cfg = model_config(args, name, pp, vpp)
            try:
                cfg.validate()
            except (ValueError, pipesim.ScheduleError) as exc:
                print(f"skip {name} pp={pp} vpp={vpp}: {exc}", file=sys.stderr)
                continue
            # The prediction, from the latest 1f1b run, before this schedule runs.
            predicted, cal = predict(cfg.build_schedule(), layout_of(cfg), calib)
            print(f"pp={pp} {name}: predicted from 1f1b run {k} before running: "
                  f"{predicted.makespan * 1e3:.0f} ms", flush=True)
            run = profiled_run(cfg, 1, args.steps, timeout=args.timeout,
                               trace_out=str(trace_dir / f"{name}.json") if trace_dir else None)
            record(pp, None, name, cfg, run, (predicted, cal, calib), f"1f1b run {k}")
            # A fresh calibration for the next schedule (the machine's load drifts); the
            # repeat, predicted from the previous 1f1b run, shows the run-to-run noise floor.
            k += 1
            fresh = run_1f1b(k)
            repeat, rcal = predict(calib.schedule, layout_of(model_config(args, "1f1b", pp, 1)), calib)
            record(pp, None, "1f1b", model_config(args, "1f1b", pp, 1), fresh, (repeat, rcal, calib),
                   f"1f1b run {k - 1}")
            calib = fresh
    print()
    print("| pp | CPUs per rank | schedule | vpp | measured step (ms) | predicted, own trace | error | "
          "predicted from 1f1b (without its own timings) | error | bubble_fraction "
          "measured | (its range over the profiled steps) | predicted (own) | predicted (1f1b) "
          "| peak act. memory error, max over ranks (own / 1f1b) | load avg |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        if "cross_ms" in r:
            cross_ms, cross_err = f"{r['cross_ms']:.0f}", pct(r["cross_err"])
            bf_cross, mem = f"{r['bf_cross']:.3f}", f"{r['mem_err']:.1%} / {r['cross_mem_err']:.1%}"
        else:
            cross_ms, cross_err, bf_cross, mem = "(calibration)", "", "", f"{r['mem_err']:.1%}"
        print(f"| {r['pp']} | {share(r['cpus'], r['pp'])} | {r['schedule']} | {r['vpp']} | {r['measured_ms']:.0f} | "
              f"{r['self_ms']:.0f} | {pct(r['self_err'])} | {cross_ms} | {cross_err} | "
              f"{r['bf_meas']:.3f} | {min(r['bf_steps']):.3f}-{max(r['bf_steps']):.3f} | "
              f"{r['bf_self']:.3f} | {bf_cross} | {mem} | {r['load']:.1f} |")
    own = [abs(r["self_err"]) for r in rows]
    cross = [abs(r["cross_err"]) for r in rows if "cross_err" in r and not r["schedule"].startswith("1f1b")]
    floor = [abs(r["cross_err"]) for r in rows if "cross_err" in r and r["schedule"].startswith("1f1b")]
    bf = [abs(r["bf_self"] - r["bf_meas"]) * 100 for r in rows]
    mem = [r["mem_err"] for r in rows]
    print(f"\nmax |error|: step time, own trace {max(own):.1%}; cross-schedule {max(cross or [0]):.1%}; "
          f"1f1b predicted from 1f1b (noise floor) {max(floor or [0]):.1%}; "
          f"bubble_fraction (own) {max(bf):.1f} points; peak activation memory (own) {max(mem):.1%}")
    for pp, cpus in dict.fromkeys((r["pp"], r["cpus"]) for r in rows):
        mine = [r for r in rows if r["pp"] == pp and r["cpus"] == cpus]
        spread = max(max(r["bf_steps"]) - min(r["bf_steps"]) for r in mine)
        crossed = [abs(r["cross_err"]) for r in mine
                   if "cross_err" in r and not r["schedule"].startswith("1f1b")]
        print(f"  pp={pp}{where(cpus)}: step time, own trace "
              f"{max(abs(r['self_err']) for r in mine):.1%}, cross-schedule "
              f"{max(crossed or [0]):.1%}; bubble_fraction, own trace "
              f"{max(abs(r['bf_self'] - r['bf_meas']) for r in mine) * 100:.1f} points, while the "
              f"measured one moves up to {spread * 100:.1f} points from step to step within a run")
    print(f"\n{len(rows)} runs in {time.time() - started:.0f} s; measured step times of the "
          "profiled steps are in each report (--out-dir).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
