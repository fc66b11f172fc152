"""The frontier picture: every simulated plan's peak memory against its throughput.

One point per simulated plan, coloured by schedule (hollow where it does not fit), the memory
limit as a line, the fitting plans' Pareto frontier (no other plan is both faster and
smaller) as a step line, and the chosen plan as a star.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..units import GiB

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from .search import SearchResult


def frontier_figure(result: "SearchResult", title: str | None = None) -> "Figure":
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = result.rows[result.rows["status"] == "simulated"]
    fig = Figure(figsize=(11, 5.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colours = schedule_colours(result.space.schedules)
    for schedule, group in rows.groupby("schedule", sort=False):
        fit = group[group["fits"] == True]   # noqa: E712
        over = group[group["fits"] != True]  # noqa: E712
        ax.scatter(fit["tokens_per_s_per_gpu"], fit["peak_memory"] / GiB, s=18,
                   color=colours[schedule], label=f"{schedule} ({len(group)})", alpha=0.8)
        ax.scatter(over["tokens_per_s_per_gpu"], over["peak_memory"] / GiB, s=18,
                   facecolors="none", edgecolors=colours[schedule], alpha=0.6)
    ax.axhline(result.memory_limit / GiB, color="k", ls="--", lw=1,
               label=f"memory limit {result.memory_limit / GiB:.1f} GiB")
    ranked = result.ranked
    if len(ranked):
        pts = ranked.sort_values("tokens_per_s_per_gpu", ascending=False)
        xs, ys, low = [], [], float("inf")
        for x, y in zip(pts["tokens_per_s_per_gpu"], pts["peak_memory"] / GiB):
            if y < low:
                xs.append(x)
                ys.append(y)
                low = y
        ax.step(xs, ys, where="post", color="0.4", lw=1, label="Pareto frontier (fits)")
        best = ranked.iloc[0]
        ax.scatter([best["tokens_per_s_per_gpu"]], [best["peak_memory"] / GiB], marker="*",
                   s=300, color="gold", edgecolors="k", zorder=5,
                   label=f"chosen: {best['key']}")
    ax.set_xlabel("tokens/s per GPU (simulated)")
    ax.xaxis.set_major_formatter("{x:,.0f}")
    ax.set_ylabel("peak memory, worst rank (GiB)")
    sp = result.space
    ax.set_title(title or f"{sp.model.name} on {sp.gpus} x {sp.hardware.name}, gbs {sp.gbs}: "
                 f"{result.simulated:,} plans simulated (hollow: does not fit)", fontsize=10)
    ax.grid(alpha=0.3)
    # outside the axes, so that no point is under it
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    return fig


def schedule_colours(schedules) -> dict[str, object]:
    """A distinct colour per schedule, in the given order: tab10's ten, black, then Dark2's."""
    from matplotlib import colormaps

    palette = [colormaps["tab10"](i) for i in range(10)] + ["black"]
    palette += [colormaps["Dark2"](i) for i in range(8)]
    return {s: palette[i % len(palette)] for i, s in enumerate(schedules)}
