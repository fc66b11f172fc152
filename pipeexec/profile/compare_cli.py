"""``pipeexec compare``: run a schedule with profiling in local workers, compare it with its
simulation, print the table and write the report, table, picture and trace files."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pipesim

from .compare import Comparison, compare_runs
from .measured import MeasuredRun
from .predict import layout_of, predict


def profiled_run(config: Any, first: int, stop: int, *, trace_out: str | None = None,
                 timeout: float | None = None, cpus_per_rank: float | None = None
                 ) -> MeasuredRun:
    """Train ``config`` in local forked workers, profiling steps ``first..stop-1``; return the
    gathered run (written to ``trace_out`` too, when given). ``cpus_per_rank``: as for
    `pipeexec.launcher.launch`."""
    from ..devices import start_method_for
    from ..launcher import launch
    from ..worker import run_training
    from .session import ProfileOptions

    options = ProfileOptions(first, stop, trace_out)
    options.check(config.steps)
    results = launch(run_training, config.world_size, (config, None, False, None, options),
                     timeout=timeout, cpus_per_rank=cpus_per_rank,
                     start_method=start_method_for(config.device, config.backend))
    run = results[0].get("measured_run")
    if run is None:
        raise RuntimeError("rank 0 returned no measured run (was the profiled range empty?)")
    return run


def compare_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pipeexec compare", add_help=False,
        description="Run a schedule for real with profiling, simulate it with costs calibrated "
                    "from that run (or from --calibrate-from), and compare. Every model and "
                    "layout flag of `pipeexec train` applies (--schedule, --pp, --vpp, "
                    "--microbatches, --layers, --hidden, ...).")
    a = p.add_argument
    a("-h", "--help", action="store_true", help="show this help and the train flags")
    a("--profile", default=None, metavar="A:B",
      help="steps to profile (default: 1:STEPS, skipping the warm-up step)")
    a("--calibrate-from", default=None, metavar="RUN_TRACE",
      help="calibrate from this measured run (its .json, .csv or .meta.json) instead of the "
           "run itself: a prediction made without this run's timings")
    a("--trace-out", default=None, metavar="FILE.json",
      help="keep the measured trace: Chrome/Perfetto JSON, with .csv and .meta.json beside it")
    a("--report-out", default=None, metavar="FILE.json", help="write the report as JSON")
    a("--table-out", default=None, metavar="FILE.csv|FILE.md",
      help="write the table as CSV, or as markdown for a .md name")
    a("--plot-out", default=None, metavar="FILE.png",
      help="predicted and measured Gantt charts on one time axis (default: beside "
           "--report-out, as .png)")
    return p


def compare_main(argv: list[str], train_parser: Callable[[], argparse.ArgumentParser],
                 config_from_args: Callable[[argparse.Namespace], Any]) -> int:
    """``pipeexec compare ...``; returns the exit status (2: bad arguments, 1: run failed)."""
    from ..cpu_quota import QuotaUnavailable
    from ..launcher import WorkerFailed
    from .session import parse_step_range

    ns, rest = compare_parser().parse_known_args(argv)
    parser = train_parser()
    if ns.help:
        compare_parser().print_help()
        print("\ntrain flags (pipeexec train --help):")
        parser.parse_args(["train", "--help"])
        return 0
    try:
        tns = parser.parse_args(["train", *rest])
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        config = config_from_args(tns)
        if config.steps < 2 and ns.profile is None:
            config = config.replace(steps=2)
        first, stop = parse_step_range(ns.profile) if ns.profile else (1, config.steps)
        config.validate(world_size=config.world_size)
        source = MeasuredRun.load(ns.calibrate_from) if ns.calibrate_from else None
        if source is not None:
            layout = layout_of(config)
            predicted, cal = predict(config.build_schedule(), layout, source)
            print(f"prediction before running, calibrated from {ns.calibrate_from}: "
                  f"{predicted.makespan * 1e3:.1f} ms, bubble_fraction "
                  f"{predicted.bubble_fraction:.3f}", flush=True)
        run = profiled_run(config, first, stop, trace_out=ns.trace_out,
                           timeout=getattr(tns, "timeout", None),
                           cpus_per_rank=getattr(tns, "cpus_per_rank", None))
        comparison = compare_runs(run, source)
    except WorkerFailed as exc:
        print(f"pipeexec compare: error: {exc}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError, pipesim.ScheduleError, QuotaUnavailable) as exc:
        print(f"pipeexec compare: error: {exc}", file=sys.stderr)
        return 2
    print(comparison.text())
    write_outputs(comparison, report_out=ns.report_out, table_out=ns.table_out,
                  plot_out=ns.plot_out, trace_out=ns.trace_out)
    return 0


def write_outputs(comparison: Comparison, *, report_out: str | None = None,
                  table_out: str | None = None, plot_out: str | None = None,
                  trace_out: str | None = None) -> dict[str, str]:
    """Write the report JSON, table CSV and picture; return their paths."""
    files: dict[str, str] = {}
    if plot_out is None and report_out is not None:
        plot_out = str(Path(report_out).with_suffix(".png"))
    if table_out:
        Path(table_out).parent.mkdir(parents=True, exist_ok=True)
        if table_out.endswith(".md"):
            Path(table_out).write_text(comparison.headline() + "\n\n" + comparison.markdown() + "\n")
        else:
            comparison.table().to_csv(table_out)
        files["table"] = table_out
    if plot_out:
        Path(plot_out).parent.mkdir(parents=True, exist_ok=True)
        comparison.figure().savefig(plot_out, dpi=110)
        files["plot"] = plot_out
    if trace_out:
        chrome, csv, meta = MeasuredRun.paths(trace_out)
        files.update(trace=str(chrome), trace_csv=str(csv), trace_meta=str(meta))
    if report_out:
        report = comparison.report()
        report["files"] = dict(files)
        path = Path(report_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        tmp.replace(path)
        files["report"] = report_out
    for kind, path in files.items():
        print(f"wrote {kind}: {path}")
    return files
