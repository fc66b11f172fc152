"""Prediction vs measurement: the comparison table and report (``pipeexec compare`` is
`compare_cli`).

`compare_runs` scores one measured run against the simulation of the same schedule with costs
calibrated from that run or from another one (`pipeexec.analysis.calibrate`). Measured values
are the means over the compared steps (by default the profiled steps but the quarter with the
longest and the quarter with the shortest makespan, `MeasuredRun.central_steps`: the costs a
simulation uses are per-stage means over the same steps, so what it predicts is the run's mean
step, and one stalled step should move neither);
each step's makespan is in the report too, and the pictures show the step with the median
makespan (`MeasuredRun.representative_step`). ``step=N`` compares that one step alone.
Definitions are pipesim's (:mod:`pipesim.sim.metrics`), computed by the same code on both traces:

* step time: the step's makespan (first action start to last action end over all ranks: the
  pipeline part of the step, which is what the schedule decides; the optimizer is not in it);
* per rank: ``finish`` (its last action's end), ``busy`` (compute time), ``bubble`` (idle time
  inside its own span) and Megatron's idle/busy ratio ``(step - busy) / busy``;
* the table's "all" row: the step time and one rank's figures, the rank that bounds the step
  (the busiest: Megatron's bubble_fraction is its idle time over its busy time), each side its
  own (`Comparison.step_ranks`): its busy time, its idle time in the step ``step - busy`` and
  their ratio, so that busy + bubble = step and bubble_fraction = bubble / busy on the row;
* overall (the report): ``bubble_fraction`` (Megatron's; measured: the mean of the steps' own,
  whose busiest rank can change from step to step, so it can differ from the "all" row's),
  ``bubble_rate`` (Zero Bubble's) and ``bubble_time`` (the slowest rank's bubble);
* peak memory: the largest activation memory the rank held at an action boundary
  (measured by the meter, predicted by pipesim's memory model with calibrated bytes).

Carried from a run at another tp / cp / ep (`pipeexec.analysis.tensor_parallel`), the
prediction holds the layers' collectives priced from a hardware file's measured figures: the
table's ``<group>_collectives_predicted`` columns (tp, cp, ep) are each rank's seconds of them
per step (``m`` microbatches through the stages it holds; "all": the largest rank's), and the
report's ``predicted_collectives`` the same per rank.

A ZeRO-2/3 run (its program holds UNSHARD / RESHARD / REDUCE_GRAD) adds a row per (action,
stage) under the table, in the markdown, in the CSV (`Comparison.csv_table`: ``row`` says
``rank`` or ``sharding``) and in the report (``sharding_actions``): count, the mean per action
(what calibration prices them with) and the sum per step, measured and predicted
(`pipeexec.analysis.sharding_rows`); a run without them shows and reports none.

Errors: ``step_time_error = (predicted - measured) / measured``; bubble_fraction error in
points (predicted - measured); memory errors relative, per rank.

Calibrated from the run itself, the costs are the compared steps' per-stage wall-time means
(how the simulation moves messages, and the model for a calibration run whose ranks shared
cores: `pipeexec.analysis.predict`). A measured run whose ranks time-shared cores carries a
``note`` in the report and under the table (`contention.time_sharing_note`), with the
``--cpus-per-rank`` that avoids it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from pipesim.sim.metrics import slowest_of

from .calibrate import Calibration, Layout, costs_summary
from .contention import time_sharing_note
from .measured_run import MeasuredRun
from .overlay import overlay_figure
from .predict import predict
from .sharding_rows import (PER_MICROBATCH_NOTE, sharding_markdown, sharding_report,
                            sharding_table, sharding_text)

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

    from pipesim import SimResult

REPORT_KEYS = ("measured_step_time", "predicted_step_time", "step_time_error",
               "measured_bubble_fraction", "predicted_bubble_fraction",
               "measured_peak_memory", "predicted_peak_memory")
TABLE_COLUMNS = ("finish", "busy", "bubble", "idle_over_busy", "peak_memory")
COLLECTIVE_GROUPS = ("tp", "cp", "ep")
MAKESPAN_NOTE = ("the pipeline's makespan, first action to last: the log's step_time adds the "
                 "optimizer step and the work between steps")


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

    def slowest_ranks(self) -> tuple[int, int]:
        """The slowest rank (the largest idle share of its own span, as `pipesim.sim.metrics`
        defines it) measured (from the compared steps' per-rank means) and predicted."""
        m = self._measured
        spans = [b + i for b, i in zip(m["busy"], m["bubble"])]
        return slowest_of(m["busy"], spans), self.predicted.slowest_rank

    def step_ranks(self) -> tuple[int, int]:
        """The rank the "all" row shows, measured (from the compared steps' per-rank means)
        and predicted: the busiest (lowest on ties), the one that bounds the step, whose idle
        time over busy time is Megatron's bubble_fraction. One rank, so that the row's busy,
        bubble and bubble_fraction are figures of the same rank and add up."""
        return (int(np.argmax(self._measured["busy"])),
                int(np.argmax(self._rank_values(self.predicted)["busy"])))

    def table(self) -> "pd.DataFrame":
        """Rows: rank 0..p-1 and "all"; columns ``<quantity>_measured``, ``_predicted``,
        ``_error`` (relative; in points for bubble_fraction) for finish, busy, bubble,
        idle_over_busy and peak_memory. "all": the step time (finish), the `step_ranks`' busy
        time, idle time in the step (bubble = step - busy) and their ratio (idle_over_busy:
        bubble_fraction), and the largest rank's peak memory; ``attrs["step_ranks"]`` names
        the ranks."""
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
        bound_m, bound_p = self.step_ranks()
        # one rank a side (the busiest): its busy time, its idle time in the step, their ratio
        busy_m, busy_p = m["busy"][bound_m], p["busy"][bound_p]
        idle_m, idle_p = o["makespan"] - busy_m, ps.makespan - busy_p
        ratio_m, ratio_p = _ratio(idle_m, busy_m), _ratio(idle_p, busy_p)
        total = {"rank": "all",
                 "finish_measured": o["makespan"], "finish_predicted": ps.makespan,
                 "finish_error": _rel(ps.makespan, o["makespan"]),
                 "busy_measured": busy_m, "busy_predicted": busy_p,
                 "busy_error": _rel(busy_p, busy_m),
                 "bubble_measured": idle_m, "bubble_predicted": idle_p,
                 "bubble_error": _rel(idle_p, idle_m),
                 "idle_over_busy_measured": ratio_m, "idle_over_busy_predicted": ratio_p,
                 "idle_over_busy_error": ratio_p - ratio_m,
                 "peak_memory_measured": max(m["peak_memory"]),
                 "peak_memory_predicted": max(p["peak_memory"]),
                 "peak_memory_error": _rel(max(p["peak_memory"]), max(m["peak_memory"]))}
        rows.append(total)
        coll = self.predicted_collectives()
        for g, per_rank in coll.items():
            for row, value in zip(rows, per_rank + [max(per_rank, default=0.0)]):
                row[f"{g}_collectives_predicted"] = value
        frame = pd.DataFrame(rows).set_index("rank")
        frame.attrs["step_ranks"] = {"measured": bound_m, "predicted": bound_p}
        return frame

    def sharding_table(self) -> "pd.DataFrame":
        """ZeRO's actions, one row per (action, stage), measured over the compared steps and
        predicted (`sharding_rows.sharding_table`); no rows for a run without them."""
        return sharding_table(self.run.trace, self.steps, self.predicted.trace)

    def csv_table(self) -> "pd.DataFrame":
        """What ``--table-out FILE.csv`` writes: one frame, first column ``row`` saying which
        table a row is from: ``rank`` (the rank rows and "all", `table`'s columns) then, for a
        run with ZeRO's actions, ``sharding`` (one per (action, stage), `sharding_table`'s
        columns, ``rank`` the stage's). Seconds and bytes, as the tables; a column the other
        kind of row lacks is empty, and a run without ZeRO's actions has no sharding columns."""
        import pandas as pd

        ranks = self.table().reset_index()
        ranks.insert(0, "row", "rank")
        shard = self.sharding_table()
        if len(shard) == 0:
            return ranks
        shard = shard.astype({"rank": str})          # as the rank rows' ("0", ..., "all")
        shard.insert(0, "row", "sharding")
        columns = (["row", "rank", "action", "stage"]
                   + [c for c in ranks.columns if c not in ("row", "rank")]
                   + [c for c in shard.columns if c not in ("row", "rank", "action", "stage")])
        both = pd.concat([ranks, shard], ignore_index=True)
        return both.astype({"stage": "Int64"})[columns]

    def predicted_collectives(self) -> dict[str, list[float]]:
        """Per group (tp, cp, ep), each rank's seconds per step of the layers' collectives the
        prediction holds, where a carry priced them (`tensor_parallel.carry_to_layout`; its
        per-microbatch stage figures in the calibration's source); {} otherwise."""
        per_stage = self.calibration.source.get("collectives")
        if not per_stage:
            return {}
        sched = self.predicted.schedule
        # each forward a rank runs, of the model part it computes (a copy counts its own)
        parts = [[sched.stage_part(a.stage) for a in sched.compute_order(r) if a.op == "F"]
                 for r in range(sched.pp)]
        out = {}
        for g in COLLECTIVE_GROUPS:
            ops = per_stage.get(g)
            if ops is None:
                continue
            out[g] = [sum(ops["forward"][p] + ops["backward_input"][p] for p in ps)
                      for ps in parts]
        return out

    def markdown(self) -> str:
        """The table as markdown: ms, MiB, errors in percent (points for bubble_fraction)."""
        t = self.table()
        head = ("| rank | step / finish (ms) meas | pred | error | busy (ms) meas | pred | "
                "bubble (ms) meas | pred | idle/busy meas | pred | points | "
                "peak act. memory (MiB) meas | pred | error |")
        lines = [head, "|" + "---:|" * (head.count("|") - 1)]
        mib = 2 ** 20
        bound_m, bound_p = self.step_ranks()
        for rank, r in t.iterrows():
            if rank == "all":           # the busiest rank's figures: say whose
                rank = f"all (rank {bound_m} meas, rank {bound_p} pred)"
            lines.append(
                f"| {rank} | {r.finish_measured * 1e3:.1f} | {r.finish_predicted * 1e3:.1f} | "
                f"{_pct(r.finish_error)} | {r.busy_measured * 1e3:.1f} | {r.busy_predicted * 1e3:.1f} | "
                f"{r.bubble_measured * 1e3:.1f} | {r.bubble_predicted * 1e3:.1f} | "
                f"{r.idle_over_busy_measured:.3f} | {r.idle_over_busy_predicted:.3f} | "
                f"{_points(r.idle_over_busy_measured, r.idle_over_busy_predicted)} | "
                f"{r.peak_memory_measured / mib:.2f} | {r.peak_memory_predicted / mib:.2f} | "
                f"{_pct(r.peak_memory_error)} |")
        shard = sharding_markdown(self.sharding_table())
        if shard:
            lines += ["", *shard]
        return "\n".join(lines)

    def text(self) -> str:
        """The table for a terminal: milliseconds, MiB, errors in percent (points for
        bubble_fraction); each quantity as measured / predicted / error."""
        t = self.table()
        mib = 2 ** 20
        groups = (("step|finish ms", "finish", 1e3, ".1f", "+.1%"),
                  ("busy ms", "busy", 1e3, ".1f", "+.1%"),
                  ("bubble ms", "bubble", 1e3, ".1f", "+.1%"),
                  ("idle/busy", "idle_over_busy", 1.0, ".3f", None),
                  ("peak act. MiB", "peak_memory", 1.0 / mib, ".2f", "+.1%"))
        head1 = f"{'':>4} |" + "|".join(f" {name:^25} " for name, *_ in groups) + "|"
        head2 = f"{'rank':>4} |" + "|".join(f" {'meas':>7} {'pred':>7} {'err':>8} "
                                            for _ in groups) + "|"
        lines = [self.headline(), "", head1, head2, "-" * len(head2)]
        for rank, row in t.iterrows():
            cells = []
            for _, q, scale, fmt, efmt in groups:
                m, p = row[f"{q}_measured"], row[f"{q}_predicted"]
                if efmt is None:
                    err = _points(m, p)
                else:
                    e = row[f"{q}_error"]
                    err = format(e, efmt) if math.isfinite(e) else "n/a"
                cells.append(f" {format(m * scale, fmt):>7} {format(p * scale, fmt):>7} {err:>8} ")
            lines.append(f"{rank:>4} |" + "|".join(cells) + "|")
        lines.append(self.legend())
        if any(_points(row["idle_over_busy_measured"], row["idle_over_busy_predicted"]) == "n/a"
               for _, row in t.iterrows()):
            lines.append("n/a: an idle/busy ratio above 1 (a rank idle most of the step) has no "
                         "error in points worth reading; compare its busy and bubble columns")
        shard = sharding_text(self.sharding_table())
        if shard:
            lines += ["", *shard]
            sharding = self.run.schedule.sharding
            if sharding is not None and sharding.grad_reduce == "per_microbatch":
                lines.append(PER_MICROBATCH_NOTE)
        coll = self.predicted_collectives()
        if coll:
            lines.append("collectives in the prediction, ms per step per rank: " + "; ".join(
                f"{g} [{', '.join(f'{x * 1e3:.1f}' for x in v)}]" for g, v in coll.items()))
        note = time_sharing_note(self.run.plan)
        if note:
            lines.append(f"note: {note}")
        edge = self.cross_schedule_edge_ranks()
        pinned = {k for v in self.calibration.pinned.values() for k in v}
        if edge and not {"embedding", "head"} <= pinned:
            lines.append(f"note: predicted from another schedule's run: the rows of rank(s) "
                         f"{', '.join(map(str, edge))} (embedding, head) are the least reliable "
                         "figures here: their costs are solved from another layout's stage sums "
                         "(the calibration run timed them alone only where it was profiled with "
                         "the split probe), and such rows have been seen off by +170% to +480% "
                         "while the step time was within 15%")
        elif edge:
            lines.append(f"note: predicted from another schedule's run: rank(s) "
                         f"{', '.join(map(str, edge))} hold the embedding and the head, whose "
                         "costs are their shares of their stages as the calibration run timed "
                         "them alone (not solved from the stage sums; a stage of one of them "
                         "alone adds the executor's measured per-action work, not the fitted "
                         "per-action term); the blocks are re-cut")
        return "\n".join(lines)

    def legend(self) -> str:
        """What the rows are, naming the rank the "all" row shows on each side."""
        bound_m, bound_p = self.step_ranks()
        return ("rank rows: the rank's finish, busy, bubble (idle inside its own span) and "
                "idle/busy over the step; 'all': the step time and the busiest rank's figures "
                f"(rank {bound_m} measured, rank {bound_p} predicted): busy, idle in the step "
                "(step - busy) and their ratio, Megatron's bubble_fraction of the compared "
                "steps' mean times; the run's bubble_fraction (headline, report) is the mean of "
                "each step's own; peak memory: the largest rank's")

    def cross_schedule_edge_ranks(self) -> list[int]:
        """The ranks holding the first or the last stage (embedding, head) when the costs come
        from a run of another schedule or layout; [] for a run's own trace."""
        s = self.measured.schedule
        if self._same_layout():
            return []
        return sorted({s.placement[0], s.placement[s.num_stages - 1]})

    def _same_layout(self) -> bool:
        """The costs come from a run of this schedule and this cut of the layers."""
        s, src = self.measured.schedule, self.calibration.source
        return src.get("schedule") == s.name and src.get("bounds") == list(self.run.plan.bounds)

    def _own_trace(self) -> bool:
        src = self.calibration.source
        return self._same_layout() and "carried_to_tp" not in src and "carried_to" not in src

    def headline(self) -> str:
        s, src = self.measured.schedule, self.calibration.source
        where = ("its own trace" if self._own_trace() else
                 f"a {src.get('schedule')} run (pp={src.get('pp')} vpp={src.get('vpp')})")
        if "carried_to" in src:
            where += (f" at {src['carried_from']}, carried to {src['carried_to']} with "
                      f"{src.get('hardware')}'s collectives")
        elif "carried_to_tp" in src:
            where += (f" at tp {src.get('tp', 1)}, carried to tp {src['carried_to_tp']} with "
                      f"{src.get('hardware')}'s collectives")
        if self.calibration.model == "processor-sharing":
            where += f", CPU work shared by {self.calibration.cores:.2f} effective cores"
        measured = self._overall["makespan"]
        over = (f"step {self.steps[0]}" if len(self.steps) == 1 else
                "mean of steps " + ", ".join(map(str, self.steps)))
        # the pipeline's makespan, not the log's step_time (which adds the optimizer step and
        # the host's work between steps): say so, or the two figures seem to disagree
        return (f"{s.name} pp={s.pp} vpp={s.parts_per_rank} m={s.num_microbatches}: predicted "
                f"{self.predicted.makespan * 1e3:.1f} ms vs measured {measured * 1e3:.1f} ms "
                f"({over}, {_pct(_rel(self.predicted.makespan, measured))}; {MAKESPAN_NOTE}); "
                f"bubble_fraction (Megatron's; measured: the mean of the steps' own) predicted "
                f"{self.predicted.bubble_fraction:.3f} vs measured "
                f"{self._overall['bubble_fraction']:.3f}; calibrated from {where}")

    # -- report ---------------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """JSON-ready: the keys of REPORT_KEYS and more (see the module docstring)."""
        ps, o = self.predicted, self._overall
        m, p = self._measured, self._rank_values(ps)
        t = self.table()
        per_rank = [{"rank": int(r), **{k: _num(v) for k, v in row.items()}}
                    for r, row in t.drop(index="all").iterrows()]
        n = ps.schedule.num_stages
        plan, measurement = self.run.plan, self.run.measurement
        shard = self.sharding_table()
        return {
            "schedule": plan.schedule_name, "pp": plan.pp, "vpp": plan.parts_per_rank,
            "microbatches": plan.microbatches, "device": plan.device,
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
            "memory_measure": measurement.memory,
            "per_rank": per_rank, "step_ranks": dict(t.attrs["step_ranks"]),
            "predicted_collectives": self.predicted_collectives(),
            "compared_steps": list(self.steps), "pictured_step": self.step,
            "measured_step_times": {str(k): v for k, v in self.run.makespans().items()},
            "clock_offsets": list(measurement.clock_offsets) or None,
            "clock_rtts": list(measurement.clock_rtts) or None,
            "calibration": {"source": self.calibration.source,
                            "repartitioned": self.calibration.repartitioned,
                            "model": self.calibration.model,
                            "effective_cores": self.calibration.cores,
                            "underdetermined": self.calibration.underdetermined,
                            "per_action": self.calibration.per_action,
                            "per_layer_kind": self.calibration.per_kind,
                            "pinned_layers": self.calibration.pinned,
                            "costs": costs_summary(self.calibration.costs, n)},
            "config": None if plan.config is None else dict(plan.config),
            "note": time_sharing_note(plan),
            **({"sharding_actions": sharding_report(shard)} if len(shard) else {}),
        }

    def figure(self) -> "Figure":
        pred, meas = self.predicted, self.measured
        what = (f"measured step {self.step} (the median of the compared steps)"
                if len(self.steps) > 1 else f"measured step {self.step}")
        s = meas.schedule
        # the title gives the pictured step's error, the statistic of the panels under it
        title = (f"{s.name} pp={s.pp} vpp={s.parts_per_rank} m={s.num_microbatches}: predicted "
                 f"{pred.makespan * 1e3:.1f} ms vs {what} {meas.makespan * 1e3:.1f} ms "
                 f"({_pct(_rel(pred.makespan, meas.makespan))})")
        if len(self.steps) > 1:
            mean = self._overall["makespan"]
            title += (f"; over the compared steps' mean {mean * 1e3:.1f} ms: "
                      f"{_pct(_rel(pred.makespan, mean))}")
        return overlay_figure(
            pred, meas, title=title,
            predicted_title=(f"predicted (the compared steps' mean costs): "
                             f"{pred.makespan * 1e3:.1f} ms, bubble_fraction "
                             f"{pred.bubble_fraction:.3f}"),
            measured_title=(f"{what}: {meas.makespan * 1e3:.1f} ms, this step's own "
                            f"bubble_fraction {meas.bubble_fraction:.3f}"))


def _pct(x: float) -> str:
    """A relative error in percent; "n/a" where it is not finite (a figure of 0 compared)."""
    return f"{x:+.1%}" if math.isfinite(x) else "n/a"


def _ratio(idle: float, busy: float) -> float:
    """Idle over busy time, as the rank rows' idle/busy (NaN without busy time)."""
    return idle / busy if busy > 0 else math.nan


def _points(measured: float, predicted: float) -> str:
    """An idle/busy error in points, or "n/a" where a ratio is above 1 (busy time near 0, the
    ratio unbounded: a difference of hundreds of points means nothing) or not finite."""
    if not (math.isfinite(measured) and math.isfinite(predicted)) or max(measured, predicted) > 1:
        return "n/a"
    return f"{(predicted - measured) * 100:+.1f}pt"


def _num(x: Any) -> Any:
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    return float(x) if isinstance(x, (int, float)) else x


def compare_runs(run: MeasuredRun, calibration_run: MeasuredRun | None = None,
                 step: int | None = None, *, contention: bool | None = None,
                 carry: Any = None) -> Comparison:
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
                                 contention=contention, carry=carry)
    return Comparison(measured, predicted, cal, run, shown, steps)
