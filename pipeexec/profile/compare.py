"""Prediction vs measurement: the comparison table, the report, and ``pipeexec compare``.

`compare_runs` scores one measured run against the simulation of the same schedule with costs
calibrated from that run or from another one (`pipeexec.profile.calibrate`). Measured values
are the means over the compared steps (by default the profiled steps but the quarter with the
longest and the quarter with the shortest makespan, `MeasuredRun.central_steps`: the costs a
simulation uses are per-stage means over the same steps, so what it predicts is the run's mean
step, and one stalled step should move neither);
each step's makespan is in the report too, and the pictures show the step with the median
makespan (`MeasuredRun.representative_step`). ``step=N`` compares that one step alone.
Definitions are pipesim's (:mod:`pipesim.metrics`), computed by the same code on both traces:

* step time: the step's makespan (first action start to last action end over all ranks: the
  pipeline part of the step, which is what the schedule decides; the optimizer is not in it);
* per rank: ``finish`` (its last action's end), ``busy`` (compute time), ``bubble`` (idle time
  inside its own span) and Megatron's idle/busy ratio ``(step - busy) / busy``;
* overall: ``bubble_fraction`` (Megatron's), ``bubble_rate`` (Zero Bubble's) and
  ``bubble_time`` (the slowest rank's bubble);
* peak memory: the largest activation memory the rank held at an action boundary
  (measured by the meter, predicted by pipesim's memory model with calibrated bytes).

Errors: ``step_time_error = (predicted - measured) / measured``; bubble_fraction error in
points (predicted - measured); memory errors relative, per rank.

Calibrated from the run itself, the costs are the compared steps' per-stage wall-time means.
Either way the simulation moves messages as the executor does (``EXECUTOR_COMM``, pipesim's
``comm="rendezvous"``): gloo and NCCL start a transfer only once the receiver has posted its
receive, which the runtime does where the schedule's RECV stands (``recv_lookahead``
computations before the one that needs the data; with 0, every message between ranks costs
its receiver the transfer time). Simulating sends as starting at once (``"async"``) hid those
waits and ran short, most for schedules with many cross-rank messages per step (interleaved,
ZB-V).
Calibrated from another run (``--calibrate-from``, cross-schedule), the costs are per-stage
wall-time means too, unless the calibration run's ranks competed for cores (a CPU run with more
ranks than cores and no ``--cpus-per-rank``): then they are its CPU work per (op, stage), and
the simulation shares the run's effective cores (:mod:`pipeexec.profile.contention`) among the
ranks computing at each moment, since how much each computation is slowed depends on the
schedule. A measured run whose ranks time-shared cores carries a ``note`` in the report and
under the table (`contention.time_sharing_note`), with the ``--cpus-per-rank`` that avoids it.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

import pipesim

from .calibrate import Calibration, Layout, calibrate, costs_summary
from .contention import effective_cores, shares_cores, time_sharing_note
from .measured import MeasuredRun

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

    from pipesim import SimResult

REPORT_KEYS = ("measured_step_time", "predicted_step_time", "step_time_error",
               "measured_bubble_fraction", "predicted_bubble_fraction",
               "measured_peak_memory", "predicted_peak_memory")
TABLE_COLUMNS = ("finish", "busy", "bubble", "idle_over_busy", "peak_memory")


def _rel(pred: float, meas: float) -> float:
    return (pred - meas) / meas if meas else (0.0 if pred == meas else math.inf)


@dataclass
class Comparison:
    """Measured steps and their prediction, with the calibration that made it. ``measured`` is
    the step drawn in pictures (``step``); the numbers are means over ``steps``."""

    measured: "SimResult"
    predicted: "SimResult"
    calibration: Calibration
    run: MeasuredRun
    step: int
    steps: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.steps = list(self.steps) or [self.step]
        results = [self.measured if s == self.step else self.run.result(s) for s in self.steps]
        per_step = [self._rank_values(r) for r in results]
        # per rank: the mean over the steps (peak memory: the largest)
        self._measured = {q: [float((np.max if q == "peak_memory" else np.mean)(
            [v[q][k] for v in per_step])) for k in range(self.measured.num_ranks)]
            for q in TABLE_COLUMNS}
        overall = {"makespan": [r.makespan for r in results],
                   "busy": [max(r.busy) for r in results],
                   "bubble_time": [r.bubble_time for r in results],
                   "bubble_fraction": [r.bubble_fraction for r in results],
                   "bubble_rate": [r.bubble_rate for r in results]}
        self._overall = {k: float(np.mean(v)) for k, v in overall.items()}
        self._bf_range = (min(overall["bubble_fraction"]), max(overall["bubble_fraction"]))

    # -- table ----------------------------------------------------------------------------------
    def _rank_values(self, r: "SimResult") -> dict[str, list[float]]:
        trace = r.trace
        t0 = float(trace["start"].min())
        finish = (trace.groupby("rank")["end"].max() - t0)
        span = r.makespan
        try:
            mem = list(r.peak_memory)
        except ValueError:          # a result without memory (no readings, no CostModel)
            mem = [math.nan] * r.num_ranks
        return {"finish": [float(finish.get(k, 0.0)) for k in range(r.num_ranks)],
                "busy": list(r.busy), "bubble": list(r.bubble),
                "idle_over_busy": [(span - b) / b if b > 0 else math.nan for b in r.busy],
                "peak_memory": list(mem)}

    def table(self) -> "pd.DataFrame":
        """Rows: rank 0..p-1 and "all"; columns ``<quantity>_measured``, ``_predicted``,
        ``_error`` (relative; in points for bubble_fraction) for finish (step time on the
        "all" row), busy, bubble, idle_over_busy (bubble_fraction on "all") and peak_memory."""
        import pandas as pd

        m, p = self._measured, self._rank_values(self.predicted)
        o = self._overall
        rows = []
        for rank in range(self.measured.num_ranks):
            row: dict[str, Any] = {"rank": str(rank)}
            for q in TABLE_COLUMNS:
                row[f"{q}_measured"] = m[q][rank]
                row[f"{q}_predicted"] = p[q][rank]
                row[f"{q}_error"] = _rel(p[q][rank], m[q][rank])
            rows.append(row)
        ps = self.predicted
        total = {"rank": "all",
                 "finish_measured": o["makespan"], "finish_predicted": ps.makespan,
                 "finish_error": _rel(ps.makespan, o["makespan"]),
                 "busy_measured": o["busy"], "busy_predicted": max(ps.busy),
                 "busy_error": _rel(max(ps.busy), o["busy"]),
                 "bubble_measured": o["bubble_time"], "bubble_predicted": ps.bubble_time,
                 "bubble_error": _rel(ps.bubble_time, o["bubble_time"]),
                 "idle_over_busy_measured": o["bubble_fraction"],
                 "idle_over_busy_predicted": ps.bubble_fraction,
                 "idle_over_busy_error": ps.bubble_fraction - o["bubble_fraction"],
                 "peak_memory_measured": max(m["peak_memory"]),
                 "peak_memory_predicted": max(p["peak_memory"]),
                 "peak_memory_error": _rel(max(p["peak_memory"]), max(m["peak_memory"]))}
        rows.append(total)
        return pd.DataFrame(rows).set_index("rank")

    def markdown(self) -> str:
        """The table as markdown: ms, MiB, errors in percent (points for bubble_fraction)."""
        t = self.table()
        head = ("| rank | step / finish (ms) meas | pred | error | busy (ms) meas | pred | "
                "bubble (ms) meas | pred | bubble_fraction (idle/busy) meas | pred | points | "
                "peak act. memory (MiB) meas | pred | error |")
        lines = [head, "|" + "---:|" * (head.count("|") - 1)]
        mib = 2 ** 20
        for rank, r in t.iterrows():
            lines.append(
                f"| {rank} | {r.finish_measured * 1e3:.1f} | {r.finish_predicted * 1e3:.1f} | "
                f"{r.finish_error:+.1%} | {r.busy_measured * 1e3:.1f} | {r.busy_predicted * 1e3:.1f} | "
                f"{r.bubble_measured * 1e3:.1f} | {r.bubble_predicted * 1e3:.1f} | "
                f"{r.idle_over_busy_measured:.3f} | {r.idle_over_busy_predicted:.3f} | "
                f"{(r.idle_over_busy_predicted - r.idle_over_busy_measured) * 100:+.1f} | "
                f"{r.peak_memory_measured / mib:.2f} | {r.peak_memory_predicted / mib:.2f} | "
                f"{r.peak_memory_error:+.1%} |")
        return "\n".join(lines)

    def text(self) -> str:
        """The table for a terminal: milliseconds, MiB, errors in percent (points for
        bubble_fraction); each quantity as measured / predicted / error."""
        t = self.table()
        mib = 2 ** 20
        groups = (("step|finish ms", "finish", 1e3, ".1f", "+.1%"),
                  ("busy ms", "busy", 1e3, ".1f", "+.1%"),
                  ("bubble ms", "bubble", 1e3, ".1f", "+.1%"),
                  ("bubble_fraction", "idle_over_busy", 1.0, ".3f", None),
                  ("peak act. MiB", "peak_memory", 1.0 / mib, ".2f", "+.1%"))
        head1 = f"{'':>4} |" + "|".join(f" {name:^25} " for name, *_ in groups) + "|"
        head2 = f"{'rank':>4} |" + "|".join(f" {'meas':>7} {'pred':>7} {'err':>8} "
                                            for _ in groups) + "|"
        lines = [self.headline(), "", head1, head2, "-" * len(head2)]
        for rank, row in t.iterrows():
            cells = []
            for _, q, scale, fmt, efmt in groups:
                m, p = row[f"{q}_measured"], row[f"{q}_predicted"]
                err = (f"{(p - m) * 100:+.1f}pt" if efmt is None
                       else format(row[f"{q}_error"], efmt))
                cells.append(f" {format(m * scale, fmt):>7} {format(p * scale, fmt):>7} {err:>8} ")
            lines.append(f"{rank:>4} |" + "|".join(cells) + "|")
        lines.append("rank rows: the rank's finish time and idle/busy; 'all': the step time, "
                     "Megatron's bubble_fraction and the slowest rank's bubble")
        note = time_sharing_note(self.run.meta)
        if note:
            lines.append(f"note: {note}")
        return "\n".join(lines)

    def headline(self) -> str:
        s, src = self.measured.schedule, self.calibration.source
        where = ("its own trace" if src.get("schedule") == s.name and src.get("bounds") ==
                 list(self.run.meta["bounds"]) else
                 f"a {src.get('schedule')} run (pp={src.get('pp')} vpp={src.get('vpp')})")
        if self.calibration.model == "processor-sharing":
            where += f", CPU work shared by {self.calibration.cores:.2f} effective cores"
        measured = self._overall["makespan"]
        over = (f"step {self.steps[0]}" if len(self.steps) == 1 else
                "mean of steps " + ", ".join(map(str, self.steps)))
        return (f"{s.name} pp={s.pp} vpp={s.vpp} m={s.num_microbatches}: predicted "
                f"{self.predicted.makespan * 1e3:.1f} ms vs measured {measured * 1e3:.1f} ms "
                f"({over}, {_rel(self.predicted.makespan, measured):+.1%}); calibrated "
                f"from {where}")

    # -- report ---------------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """JSON-ready: the keys of REPORT_KEYS and more (see the module docstring)."""
        ps, o = self.predicted, self._overall
        m, p = self._measured, self._rank_values(ps)
        t = self.table()
        per_rank = [{"rank": int(r), **{k: _num(v) for k, v in row.items()}}
                    for r, row in t.drop(index="all").iterrows()]
        n = ps.schedule.num_stages
        meta = self.run.meta
        return {
            "schedule": meta["schedule"], "pp": meta["pp"], "vpp": meta["vpp"],
            "microbatches": meta["microbatches"], "device": meta.get("device"),
            "measured_step_time": o["makespan"], "predicted_step_time": ps.makespan,
            "step_time_error": _rel(ps.makespan, o["makespan"]),
            "measured_bubble_fraction": o["bubble_fraction"],
            "predicted_bubble_fraction": ps.bubble_fraction,
            "bubble_fraction_error": ps.bubble_fraction - o["bubble_fraction"],
            "measured_bubble_fraction_range": list(self._bf_range),
            "measured_bubble_rate": o["bubble_rate"], "predicted_bubble_rate": ps.bubble_rate,
            "measured_bubble_time": o["bubble_time"], "predicted_bubble_time": ps.bubble_time,
            "measured_peak_memory": [_num(x) for x in m["peak_memory"]],
            "predicted_peak_memory": [_num(x) for x in p["peak_memory"]],
            "peak_memory_error": [_num(_rel(a, b)) for a, b in zip(p["peak_memory"], m["peak_memory"])],
            "memory_measure": meta.get("memory"),
            "per_rank": per_rank,
            "compared_steps": list(self.steps), "pictured_step": self.step,
            "measured_step_times": {str(k): v for k, v in self.run.makespans().items()},
            "clock_offsets": meta.get("clock_offsets"), "clock_rtts": meta.get("clock_rtts"),
            "calibration": {"source": self.calibration.source,
                            "repartitioned": self.calibration.repartitioned,
                            "model": self.calibration.model,
                            "effective_cores": self.calibration.cores,
                            "underdetermined": self.calibration.underdetermined,
                            "per_action": self.calibration.per_action,
                            "per_layer_kind": self.calibration.per_kind,
                            "costs": costs_summary(self.calibration.costs, n)},
            "config": meta.get("config"),
            "note": time_sharing_note(meta),
        }

    def figure(self) -> "Figure":
        from .overlay import overlay_figure

        return overlay_figure(self.predicted, self.measured, title=self.headline())


def _num(x: Any) -> Any:
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    return float(x) if isinstance(x, (int, float)) else x


# How pipeexec's transports move a message: gloo (and NCCL) start a point-to-point transfer only
# once the receiver has posted its receive (at the schedule's RECV action).
EXECUTOR_COMM = "rendezvous"


def predict(schedule: "pipesim.Schedule", layout: Layout, calibration_run: MeasuredRun,
            steps: list[int] | None = None, *, contention: bool | None = None,
            comm: str = EXECUTOR_COMM) -> tuple["SimResult", Calibration]:
    """Simulate ``schedule`` cut as ``layout`` with costs calibrated on ``calibration_run``
    (its ``steps``, default its `central_steps`): the prediction before (or without) running
    it.

    ``comm``: the simulator's communication mode (``pipesim.simulate``); by default the
    executor's rendezvous, where a transfer starts when both sides have posted.

    ``contention`` (default: when the calibration run recorded CPU work, i.e. on CPU, and its
    ranks competed for cores, `contention.shares_cores`): model ranks sharing cores. Costs are then the CPU work per (op, stage), and the simulation shares
    the calibration run's effective core count among the ranks computing at each moment of the
    *target* schedule (``pipesim.simulate(cores=...)``, processor sharing); otherwise per-stage
    wall-time means.
    """
    from .calibrate import has_cpu_times

    if steps is None:
        steps = calibration_run.central_steps()
    if contention is None:
        contention = has_cpu_times(calibration_run) and shares_cores(calibration_run.meta)
    if not contention:
        cal = calibrate(calibration_run, layout, steps)
        return pipesim.simulate(schedule, cal.costs, comm=comm), cal
    cal = calibrate(calibration_run, layout, steps, work=True)
    trace = calibration_run.trace
    cores = effective_cores(trace[trace["step"].isin(steps)])
    cal.model, cal.cores = "processor-sharing", cores
    return pipesim.simulate(schedule, cal.costs, comm=comm, cores=cores), cal


def compare_runs(run: MeasuredRun, calibration_run: MeasuredRun | None = None,
                 step: int | None = None, *, contention: bool | None = None) -> Comparison:
    """Compare ``run``'s profiled steps (the means over its `central_steps`; ``step``: that
    step alone) with a simulation.

    Costs come from ``calibration_run`` (its central steps; ``contention`` as in `predict`),
    or by default from the compared steps themselves: then the question is only
    whether the simulator reproduces the run's timing from its per-stage costs. The run's own
    costs are its per-stage wall-time means unless ``contention=True`` (CPU work shared by the
    run's effective cores): the means carry the run's own contention, and give each rank
    exactly its measured busy time, which the sharing model does not (on 4 ranks over 2 vCPUs
    it gets the step time as close but spreads busy time differently over the ranks, so
    bubble_fraction further off)."""
    steps = run.central_steps() if step is None else [step]
    shown = run.representative_step() if step is None else step
    measured = run.result(shown)
    if calibration_run is None:
        predicted, cal = predict(run.schedule, Layout.of_run(run), run, steps,
                                 contention=bool(contention))
    else:
        predicted, cal = predict(run.schedule, Layout.of_run(run), calibration_run,
                                 contention=contention)
    return Comparison(measured, predicted, cal, run, shown, steps)


def layout_of(config: Any) -> Layout:
    """The layout ``config`` will run with, computed without running (same code as Trainer)."""
    from ..model import gpt_spec_from_config
    from ..partition import make_partition
    from .session import layer_kinds

    spec = gpt_spec_from_config(config)
    bounds = make_partition(spec.num_layers, config.num_stages, config.partition,
                            config.boundaries,
                            spec.layer_param_counts() if config.partition == "params" else None)
    return Layout(tuple(bounds), tuple(layer_kinds(spec.num_layers, config)))


def profiled_run(config: Any, first: int, stop: int, *, trace_out: str | None = None,
                 timeout: float | None = None, cpus_per_rank: float | None = None
                 ) -> MeasuredRun:
    """Train ``config`` in local forked workers, profiling steps ``first..stop-1``; return the
    gathered run (written to ``trace_out`` too, when given). ``cpus_per_rank``: as for
    `pipeexec.launcher.launch`."""
    from ..launcher import launch
    from ..worker import run_training
    from .session import ProfileOptions

    options = ProfileOptions(first, stop, trace_out)
    options.check(config.steps)
    results = launch(run_training, config.world_size, (config, None, False, None, options),
                     timeout=timeout, cpus_per_rank=cpus_per_rank)
    run = results[0].get("measured_run")
    if run is None:
        raise RuntimeError("rank 0 returned no measured run (was the profiled range empty?)")
    return run


# -- pipeexec compare --------------------------------------------------------------------------
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
