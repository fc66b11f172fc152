"""Why the winner: the best plan of each other schedule, and each neighbour one knob away.

A neighbour changes one knob of the winner to the next value searched, below or above (tp, cp,
pp, vpp, mbs, recompute, zero, ep, ep_dispatcher; dp absorbs the GPU count, so tp 8 -> 4 with pp
fixed doubles dp; ep down to 1 takes the one dispatcher ep 1 has), the schedule staying the
same. A neighbour the search pruned is simulated here, so every
row has its step time and peak memory. Differences are the other plan minus the winner. Each
row's ``change`` names every knob in which its plan differs from the winner's (a schedule's
best plan may have another layout too: ``schedule zbv -> 1f1b, cp 2 -> 1, dp 32 -> 64``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .search import SIMULATED, evaluate_plan
from ..plan.parallelism import EP_DISPATCHERS, RECOMPUTE
from ..units import GiB

if TYPE_CHECKING:
    import pandas as pd

    from .search import SearchResult

KNOBS = ("tp", "cp", "pp", "vpp", "mbs", "recompute", "zero", "ep", "ep_dispatcher")
# what a row's change names: every field of a plan's layout (microbatches follow from dp, mbs)
CHANGED = ("schedule", "tp", "cp", "pp", "vpp", "dp", "ep", "ep_dispatcher", "mbs", "recompute",
           "zero")


def explain(result: "SearchResult") -> "pd.DataFrame":
    """Rows: kind (``schedule`` or ``neighbour``), change, key, step_time, d_step (fraction of
    the winner's), peak_memory, d_memory (bytes), fits, reason. Empty when nothing fits."""
    import pandas as pd

    ranked = result.ranked
    cols = ["kind", "change", "key", "step_time", "d_step", "peak_memory", "d_memory", "fits",
            "reason"]
    if not len(ranked):
        return pd.DataFrame(columns=cols)
    win = ranked.iloc[0]
    rows = result.rows
    out: list[dict[str, Any]] = []

    def add(kind: str, row) -> None:
        row = _simulated(result, row)
        out.append({"kind": kind, "change": changes(win, row), "key": row["key"],
                    "step_time": row["step_time"],
                    "d_step": row["step_time"] / win["step_time"] - 1.0,
                    "peak_memory": row["peak_memory"],
                    "d_memory": row["peak_memory"] - win["peak_memory"],
                    "fits": bool(row["fits"]), "reason": row["reason"] or ""})

    for schedule in result.space.schedules:
        if schedule == win["schedule"]:
            continue
        mine = ranked[ranked["schedule"] == schedule]
        if len(mine):
            add("schedule", mine.iloc[0])
    same = rows[(rows["schedule"] == win["schedule"]) & (rows["status"] != "invalid")]
    for knob in KNOBS:
        values = sorted(set(same[knob]), key=_order(knob))
        if len(values) < 2:
            continue
        at = values.index(win[knob])
        for step in (-1, 1):
            j = at + step
            if not 0 <= j < len(values):
                continue
            mask = same[knob] == values[j]
            for other in KNOBS:
                # ep 1 has one dispatcher (the default), whichever the winner's
                if other != knob and not (knob == "ep" and values[j] == 1
                                          and other == "ep_dispatcher"):
                    mask &= same[other] == win[other]
            hit = same[mask]
            if len(hit):
                add("neighbour", hit.iloc[0])
    return pd.DataFrame(out, columns=cols)


def changes(winner, row) -> str:
    """``knob a -> b`` for every knob of `CHANGED` in which ``row`` differs from ``winner``."""
    return ", ".join(f"{k} {winner[k]} -> {row[k]}" for k in CHANGED if row[k] != winner[k])


def _order(knob: str):
    return {"recompute": RECOMPUTE.index, "ep_dispatcher": EP_DISPATCHERS.index}.get(
        knob, lambda v: v)


def _simulated(result: "SearchResult", row):
    """The row with its simulation (run here if the search pruned it)."""
    if row["status"] == SIMULATED:
        return row
    res = evaluate_plan(result.plans[row["key"]], result.memory_limit).columns()
    row = row.copy()
    for k, v in res.items():
        row[k] = v
    idx = result.rows.index[result.rows["key"] == row["key"]]
    for k, v in res.items():
        if k in result.rows.columns:
            result.rows.loc[idx, k] = v
    result.rows.loc[idx, "reason"] = (row["reason"] or "") + " (simulated to explain)"
    return row


def explain_text(table: "pd.DataFrame", winner_key: str, winner_step: float,
                 winner_peak: float) -> str:
    from ..units import column_decimals

    width = max([28, *(len(c) for c in table["change"])])
    d = column_decimals([winner_step, *table["step_time"]])
    lines = [f"why {winner_key} ({winner_step:.{d}f} s, peak {winner_peak / GiB:.1f} GiB): each "
             "row changes the knobs it names",
             f"  {'vs':<10} {'change':<{width}} {'step s':>9} {'d step':>8} {'peak GiB':>9} "
             f"{'d GiB':>7}  fits"]
    for _, r in table.iterrows():
        lines.append(f"  {r['kind']:<10} {r['change']:<{width}} {r['step_time']:>9.{d}f} "
                     f"{r['d_step']:>+8.1%} {r['peak_memory'] / GiB:>9.1f} "
                     f"{r['d_memory'] / GiB:>+7.1f}  {'yes' if r['fits'] else 'no'}")
    return "\n".join(lines)
