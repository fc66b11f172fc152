"""ZeRO's actions predicted vs measured: the rows `pipeexec compare` adds for a ZeRO-2/3 run.

A run lowered with a sharding (`pipesim.schedule.sharding`) runs UNSHARD / RESHARD /
REDUCE_GRAD actions; the measured trace times each (`measured_run.build_trace`: a collective
from when the rank was free to its end, as the simulator's rows on a rank that waits for its
collectives) and
calibration prices UNSHARD and REDUCE_GRAD per stage by their means, as the computations
(`pipesim.sim.calibrate.fit_costs`). The per-rank table shows what they do to the step (a
sharding row is communication: it is in a rank's bubble, not its busy time); these rows show
the actions themselves, one per (action, stage), so that a gather priced wrong is seen as such
and not only as a step that is off:

* ``count``: actions per step (measured: the compared steps' mean; the program fixes it);
* ``per_action``: the mean duration, the statistic calibration prices them with (predicted:
  the simulated rows' mean, a stage's actions all costing the same);
* ``per_step``: their summed duration in a step (measured: the compared steps' mean).

A RESHARD (a release) is free in the model; its measured row holds the release alone (the
executor's work before it stays in the next row), time the prediction does not have. Under ``grad_reduce="per_microbatch"`` a REDUCE_GRAD only
flushes the buckets its backward left incomplete: the full ones are reduce-scattered inside
the B / W that filled them, and are timed there.

Torch-free, as the rest of the analysis.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pipesim.schedule.action import REDUCE_GRAD, RESHARD, UNSHARD

if TYPE_CHECKING:
    import pandas as pd

SHARDING_OPS = (UNSHARD, RESHARD, REDUCE_GRAD)        # the rows' order
QUANTITIES = ("count", "per_action", "per_step")
LEGEND = ("ZeRO's actions per stage: count a step; per action: the mean (what calibration "
          "prices UNSHARD and REDUCE_GRAD with); per step: their sum (measured: the compared "
          "steps' mean); RESHARD (a release) is free in the model: its measured time is what "
          "the prediction leaves out")
PER_MICROBATCH_NOTE = ("grad_reduce per_microbatch: a REDUCE_GRAD flushes what its backward "
                       "left; the full buckets' reduce-scatters run, and are timed, inside the "
                       "B / W that filled them")


def _rel(pred: float, meas: float) -> float:
    if math.isnan(pred) or math.isnan(meas):
        return math.nan
    return (pred - meas) / meas if meas else (0.0 if pred == meas else math.inf)


def _stats(trace: "pd.DataFrame", steps: int) -> dict[tuple[str, int], dict[str, Any]]:
    """Per (op, stage) of ``trace``'s sharding rows: rank, count and summed seconds per step
    (over ``steps`` steps), mean seconds per action."""
    ops = trace["op"].astype(str)
    rows = trace[ops.isin(SHARDING_OPS)]
    out: dict[tuple[str, int], dict[str, Any]] = {}
    if len(rows) == 0:
        return out
    dur = (rows["end"] - rows["start"]).astype(float)
    keys = [rows["op"].astype(str), rows["stage"].astype(int)]
    for (op, stage), d in dur.groupby(keys):
        # a stage is on one rank (`Schedule.placement`)
        out[(str(op), int(stage))] = {"rank": int(rows.at[d.index[0], "rank"]),
                                      "count": len(d) / steps, "per_action": float(d.mean()),
                                      "per_step": float(d.sum()) / steps}
    return out


def sharding_table(measured: "pd.DataFrame", steps: Sequence[int],
                   predicted: "pd.DataFrame") -> "pd.DataFrame":
    """One row per (action, stage) that either trace has, in `SHARDING_OPS` order then by
    stage: columns ``action``, ``stage``, ``rank`` and ``<quantity>_measured`` /
    ``_predicted`` / ``_error`` (relative; NaN where a side lacks the row) for `QUANTITIES`.
    ``measured``: the measured run's trace (a ``step`` column), of which ``steps`` are
    compared; ``predicted``: one simulated step. Empty (no rows) for a run without them."""
    import pandas as pd

    if not steps:
        raise ValueError("sharding_table: no compared steps")
    rows_m = measured[measured["step"].isin(list(steps))]
    m, p = _stats(rows_m, len(steps)), _stats(predicted, 1)
    order = {op: k for k, op in enumerate(SHARDING_OPS)}
    table = []
    for op, stage in sorted(set(m) | set(p), key=lambda k: (order[k[0]], k[1])):
        got_m, got_p = m.get((op, stage)), p.get((op, stage))
        rank = (got_m or got_p)["rank"]
        row: dict[str, Any] = {"action": op, "stage": stage, "rank": rank}
        for q in QUANTITIES:
            vm = got_m[q] if got_m else (0.0 if q != "per_action" else math.nan)
            vp = got_p[q] if got_p else (0.0 if q != "per_action" else math.nan)
            row[f"{q}_measured"], row[f"{q}_predicted"] = vm, vp
            row[f"{q}_error"] = _rel(vp, vm)
        table.append(row)
    columns = ["action", "stage", "rank"] + [f"{q}_{side}" for q in QUANTITIES
                                             for side in ("measured", "predicted", "error")]
    return pd.DataFrame(table, columns=columns)


def _pct(x: float) -> str:
    return f"{x:+.1%}" if math.isfinite(x) else "n/a"


def _ms(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x * 1e3:.3f}"


def _count(x: float) -> str:
    return f"{x:g}"


def sharding_text(table: "pd.DataFrame") -> list[str]:
    """The rows for a terminal (milliseconds, errors in percent), a header and the legend;
    [] when there are none."""
    if len(table) == 0:
        return []
    head1 = (f"{'':>11} {'':>5} {'':>4} | {'count':^13} | {'per action ms':^26} | "
             f"{'per step ms':^26} |")
    head2 = (f"{'action':>11} {'stage':>5} {'rank':>4} | {'meas':>6} {'pred':>6} | "
             + " | ".join(f"{'meas':>8} {'pred':>8} {'err':>8}" for _ in range(2)) + " |")
    lines = [head1, head2, "-" * len(head2)]
    for r in table.itertuples(index=False):
        lines.append(
            f"{r.action:>11} {r.stage:>5} {str(r.rank):>4} | {_count(r.count_measured):>6} "
            f"{_count(r.count_predicted):>6} | {_ms(r.per_action_measured):>8} "
            f"{_ms(r.per_action_predicted):>8} {_pct(r.per_action_error):>8} | "
            f"{_ms(r.per_step_measured):>8} {_ms(r.per_step_predicted):>8} "
            f"{_pct(r.per_step_error):>8} |")
    lines.append(LEGEND)
    return lines


def sharding_markdown(table: "pd.DataFrame") -> list[str]:
    """The rows as a markdown table; [] when there are none."""
    if len(table) == 0:
        return []
    head = ("| action | stage | rank | count meas | pred | per action (ms) meas | pred | error "
            "| per step (ms) meas | pred | error |")
    lines = [head, "|" + "---:|" * (head.count("|") - 1)]
    for r in table.itertuples(index=False):
        lines.append(
            f"| {r.action} | {r.stage} | {r.rank} | {_count(r.count_measured)} | "
            f"{_count(r.count_predicted)} | {_ms(r.per_action_measured)} | "
            f"{_ms(r.per_action_predicted)} | {_pct(r.per_action_error)} | "
            f"{_ms(r.per_step_measured)} | {_ms(r.per_step_predicted)} | "
            f"{_pct(r.per_step_error)} |")
    return lines


def sharding_report(table: "pd.DataFrame") -> list[dict[str, Any]]:
    """The rows JSON-ready (non-finite numbers as None)."""
    def num(key: str, x: Any) -> Any:
        if key == "action":
            return str(x)
        if key in ("stage", "rank"):
            return int(x)
        x = float(x)
        return x if math.isfinite(x) else None
    return [{k: num(k, v) for k, v in row.items()} for row in table.to_dict(orient="records")]
