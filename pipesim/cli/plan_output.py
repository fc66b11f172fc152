"""What `pipesim plan` prints about a search and the files it writes.

One count from one place: `summary_text` reads the search's rows once everything that simulates
(the search, the "why" table's neighbours) has run, so the summary, the frontier's title and the
CSV's ``status`` column count the same plans. Files are written only where a flag names them,
and only when the search found a plan: a failed search writes nothing, so a directory never
holds the files of two runs.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..planner.search import SearchResult

REFUSALS_SHOWN = 8


def summary_text(result: "SearchResult") -> str:
    """``N plans enumerated (R combinations refused), S simulated, ...; T s`` and the refused
    combinations counted by reason, most common first."""
    counts = result.counts()
    simulated = counts.pop("simulated", 0)
    parts = [f"{simulated:,} simulated"] + [f"{n:,} {status}" for status, n in counts.items()]
    refused = sum(result.refused.values())
    lines = [f"{counted(len(result.rows), 'plan')} enumerated "
             f"({counted(refused, 'combination')} refused), "
             + ", ".join(parts) + f"; search {result.timing['wall']:.1f} s"]
    lines += refusals_lines(result.refused)
    return "\n".join(lines)


def counted(n: int, noun: str) -> str:
    """``1 plan``, ``2 plans``, ``1,024 plans``: a count with its noun in the right number."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def refusals_lines(refused: Counter, shown: int = REFUSALS_SHOWN) -> list[str]:
    """The refused combinations by reason, indented, at most ``shown`` reasons."""
    common = refused.most_common()
    lines = [f"  refused {n:>8,}  {reason}" for reason, n in common[:shown]]
    if len(common) > shown:
        rest = sum(n for _, n in common[shown:])
        lines.append(f"  refused {rest:>8,}  ({len(common) - shown} more reasons)")
    return lines


def write_rows(rows: Any, out: Path) -> str:
    """Every evaluated plan to ``out`` (.csv or .parquet); the line saying so."""
    if out.suffix == ".parquet":
        rows.to_parquet(out, index=False)
    else:
        rows.to_csv(out, index=False)
    return f"wrote {out} ({len(rows):,} plans: every evaluated plan, its status and figures)"


def nothing_written_text(flags: dict[str, str | None]) -> str:
    """The line for a run that wrote no file, naming the flags that would have."""
    asked = [f"{flag} {path}" for flag, path in flags.items() if path]
    if asked:
        return "no files written (" + ", ".join(asked) + " left as they were)"
    return ("no files written: --out FILE (every evaluated plan), --plan-out FILE (the best "
            "plan), --frontier PNG and --gantt PNG write them")


def plan_gantt(r: Any, key: str) -> Any:
    """The best plan's Gantt chart with memory, titled with its model, cluster and layout, the
    step tail drawn after each rank's pipeline (exposed data-parallel reduction, optimizer
    step) so the axis reaches the step time the title gives. ``r``: a ``PlanResult``."""
    from matplotlib.patches import Patch

    from ..sim.plot import COMM_COLORS, OP_COLORS

    plan = r.plan
    hw = plan.cluster.hardware
    title = (f"{plan.model.name} on {plan.world_size:,} x {hw.name}: {key}\n"
             f"step {_seconds(r.step_time)} = pipeline {_seconds(r.pipeline_time)} + step tail "
             "(exposed data-parallel reduction, optimizer)")
    per_rank = len(r.sim.trace.query("kind == 'compute'")) / max(r.sim.num_ranks, 1)
    fig = r.gantt(memory=True, labels=per_rank <= 64, title=title,
                  figsize=(14.0, 1.6 + 0.32 * r.sim.num_ranks + 2.2))
    ax = fig.axes[0]
    ends = r.sim.rank_end
    colours = (COMM_COLORS["ALLREDUCE"], OP_COLORS["OPTIMIZER"])
    for rank, tail in enumerate(r.derived.tail[:len(ends)]):
        ax.broken_barh([(ends[rank], tail.dp_exposed),
                        (ends[rank] + tail.dp_exposed, tail.optimizer)],
                       (rank - 0.4, 0.8), facecolors=colours, linewidth=0)
    ax.set_xlim(0.0, max(r.step_time, r.pipeline_time))
    legend = ax.get_legend()
    handles = list(legend.legend_handles) if legend is not None else []
    handles += [Patch(color=colours[0], label="dp reduction (exposed)"),
                Patch(color=colours[1], label="optimizer step")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
              frameon=False)
    return fig


def _seconds(x: float) -> str:
    return f"{x:.3f} s" if x >= 0.01 else f"{x * 1e3:.3g} ms"
