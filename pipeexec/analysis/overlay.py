"""Predicted and measured Gantt charts one above the other, on one time axis.

Both panels are drawn by `pipesim.sim.plot.gantt` (so they look exactly like every other chart of
the project) with the same x range: the longer of the two makespans, so a prediction that is
too short or too long shows as a shorter or longer bar field, rank by rank.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pipesim.sim.plot import gantt

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from pipesim import SimResult


def overlay_figure(predicted: "SimResult", measured: "SimResult", *, title: str | None = None,
                   comm: bool = True, predicted_title: str | None = None,
                   measured_title: str | None = None) -> "Figure":
    """A two-panel figure: predicted (top) and measured (bottom), shared time axis. ``title``
    is wrapped to the figure's width; the panel titles default to each panel's step time and
    bubble_fraction."""
    import textwrap

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ranks = max(predicted.num_ranks, measured.num_ranks)
    span = max(predicted.makespan, measured.makespan)
    per_rank = int((measured.trace["kind"] == "compute").sum()) / max(ranks, 1)
    width = min(max(10.0, 8.0 + 0.08 * per_rank), 22.0)
    lines = textwrap.wrap(title, int(width * 9.5)) if title else []
    height = 2 * (0.9 + 0.4 * ranks) + 0.25 * len(lines) + 0.3 * bool(lines)
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True)
    gantt(predicted, ax=top, comm=comm, xlim=(0.0, span),
          title=predicted_title or (f"predicted: step {predicted.makespan * 1e3:.1f} ms, "
                                    f"bubble_fraction {predicted.bubble_fraction:.3f}"))
    gantt(measured, ax=bottom, comm=comm, xlim=(0.0, span),
          title=measured_title or (f"measured: step {measured.makespan * 1e3:.1f} ms, "
                                   f"bubble_fraction {measured.bubble_fraction:.3f}"))
    top.set_xlabel("")
    if lines:
        fig.suptitle("\n".join(lines), fontsize=11)
    # a panel as tall as its legend at least (a ZeRO run's adds its actions' entries; with a
    # rank or two the bars alone would leave the legend no room)
    entries = max(len(ax.get_legend().get_texts()) if ax.get_legend() else 0
                  for ax in (top, bottom))
    need = 2 * (0.5 + 0.2 * entries) + 0.25 * len(lines) + 0.3 * bool(lines)
    if need > height:
        fig.set_size_inches(width, need)
    return fig
