"""Gantt charts of a trace: one row per rank, a colour per op, chunks by shade.

Drawn on a bare :class:`matplotlib.figure.Figure` with the Agg canvas: no pyplot, no global
backend switch, nothing shown; the caller saves it (``fig.savefig``) or a notebook displays it.
Boxes are drawn with one ``broken_barh`` per (op, chunk), so a chart of 100k spans stays quick;
microbatch numbers are written only in boxes wide enough to hold them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..units import byte_unit

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from .result import SimResult

OP_COLORS = {"F": "#3b75af", "B": "#4a9a52", "I": "#e08b2d", "W": "#8a63b8",
             "OPTIMIZER": "#7f7f7f"}
# Communication lanes in colours no compute box has, whatever its chunk's shade: a chunk-1
# backward is a light green, a chunk-1 forward a light blue, chunk shades in the legend grey.
COMM_COLORS = {"SEND_F": "#17becf", "SEND_B": "#bcbd22", "RECV_F": "#e7969c", "RECV_B": "#e7969c",
               "ALLREDUCE": "#c0504d"}
# ZeRO's sharding actions (`pipesim.schedule.sharding`), drawn whatever ``comm`` says: a thin
# band at the top of the rank's row, the data-parallel lane
SHARD_COLORS = {"UNSHARD": "#1f77b4", "REDUCE_GRAD": "#d62728"}
_IDLE = "#f3f3f3"


def _shade(color: str, chunk: int, chunks: int) -> tuple[float, float, float]:
    """Chunk 0 in the full colour, later chunks mixed towards white (up to 60%)."""
    from matplotlib.colors import to_rgb

    rgb = np.array(to_rgb(color))
    mix = 0.0 if chunks <= 1 else 0.6 * chunk / (chunks - 1)
    return tuple(rgb + (1.0 - rgb) * mix)


def gantt(result: "SimResult", *, comm: bool = False, memory: bool = False,
          labels: bool = True, title: str | None = None, figsize: tuple[float, float] | None = None,
          ax: "Axes | None" = None, xlim: tuple[float, float] | None = None,
          unitless: bool = False) -> "Figure":
    """Draw ``result`` (a :class:`pipesim.SimResult`, simulated or measured).

    * ``comm``: a thin lane under each rank with its transfers (SEND spans) and waits (RECV).
      ZeRO's UNSHARD (all-gather) and REDUCE_GRAD (reduce-scatter) spans, when the schedule
      has them, are drawn either way, in a band at the top of the rank's row.
    * ``memory``: a subplot under the chart with each rank's bytes held over time (needs the
      result to have memory: a CostModel or a measured memory timeline).
    * ``labels``: microbatch numbers in the boxes they fit in.
    * ``ax``: draw the chart into an existing Axes (then ``memory`` is not drawn).
    * ``xlim``: the time axis range in seconds from the step start, e.g. to put predicted and
      measured charts on one axis.
    * ``unitless``: the costs are unit counts (``CostModel.uniform``): axes say "units", not
      seconds and bytes.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    trace = result.trace
    ranks = result.num_ranks
    t0 = float(trace["start"].min())
    span = max(result.makespan, 1e-30)
    chunks = int(trace["chunk"].max()) + 1 if (trace["chunk"] >= 0).any() else 1
    if ax is None:
        # Wider for long schedules, so that two-digit microbatch numbers fit at pp=16, m=64.
        per_rank = int((trace["kind"] == "compute").sum()) / max(ranks, 1)
        width = float(np.clip(8.0 + 0.08 * per_rank, 10.0, 22.0))
        height = 0.9 + 0.32 * ranks * (1.25 if comm else 1.0)
        if figsize is None:
            figsize = (width, height + (2.2 if memory else 0.0))
        fig = Figure(figsize=figsize, layout="constrained")
        FigureCanvasAgg(fig)
        if memory:
            ax, mem_ax = fig.subplots(2, 1, sharex=True,
                                      gridspec_kw={"height_ratios": [height, 2.2]})
        else:
            ax, mem_ax = fig.subplots(), None
    else:
        fig, mem_ax = ax.figure, None

    bar_top, bar_h = (-0.42, 0.6) if comm else (-0.4, 0.8)
    for r in range(ranks):
        ax.broken_barh([(0.0, span)], (r + bar_top, bar_h), facecolors=_IDLE, linewidth=0)

    compute = trace[trace["kind"] == "compute"]
    # white edges separate boxes a few pixels wide; on thousands of boxes a rank they would
    # draw stripes of white, so long schedules get none
    edge = 0.3 if len(compute) / max(ranks, 1) <= 300 else 0.0
    starts = compute["start"].to_numpy(float) - t0
    durs = compute["end"].to_numpy(float) - compute["start"].to_numpy(float)
    rank_col = compute["rank"].to_numpy(int)
    op_col = compute["op"].astype(str).to_numpy()
    chunk_col = compute["chunk"].to_numpy(int)
    for op in sorted(set(op_col), key=lambda o: list(OP_COLORS).index(o) if o in OP_COLORS else 99):
        for c in sorted(set(chunk_col[op_col == op])):
            sel = (op_col == op) & (chunk_col == c)
            color = _shade(OP_COLORS.get(op, "#444444"), max(c, 0), chunks)
            for r in sorted(set(rank_col[sel])):
                rs = sel & (rank_col == r)
                ax.broken_barh(list(zip(starts[rs], durs[rs])), (r + bar_top, bar_h),
                               facecolors=[color], edgecolors="white", linewidth=edge)

    if comm:
        rows = trace[trace["kind"] == "comm"]
        cs = rows["start"].to_numpy(float) - t0
        cd = rows["end"].to_numpy(float) - rows["start"].to_numpy(float)
        cr = rows["rank"].to_numpy(int)
        cop = rows["op"].astype(str).to_numpy()
        for op in sorted(set(cop)):
            sel = (cop == op) & (cd > 0)
            for r in sorted(set(cr[sel])):
                rs = sel & (cr == r)
                ax.broken_barh(list(zip(cs[rs], cd[rs])), (r + 0.22, 0.18),
                               facecolors=COMM_COLORS.get(op, "#999999"), linewidth=0)

    op_all = trace["op"].astype(str).to_numpy()
    sharded = np.isin(op_all, list(SHARD_COLORS))
    if sharded.any():
        rows = trace[sharded]
        ss = rows["start"].to_numpy(float) - t0
        sd = rows["end"].to_numpy(float) - rows["start"].to_numpy(float)
        sr = rows["rank"].to_numpy(int)
        sop = op_all[sharded]
        for op, color in SHARD_COLORS.items():
            for r in sorted(set(sr[sop == op])):
                sel = (sop == op) & (sr == r) & (sd > 0)
                ax.broken_barh(list(zip(ss[sel], sd[sel])), (r - 0.49, 0.07),
                               facecolors=color, linewidth=0)

    ax.set_ylim(ranks - 0.5, -0.5)
    ax.set_xlim(*(xlim if xlim is not None else (0.0, span)))
    ax.set_yticks(range(ranks))
    ax.set_yticklabels([f"rank {r}" for r in range(ranks)], fontsize=8 if ranks <= 24 else 6)
    ax.tick_params(axis="x", labelsize=8)
    time_label = "time (units)" if unitless else "time (s)"
    if mem_ax is None:
        ax.set_xlabel(time_label)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)

    if labels:
        dark = np.array([_luminance(_shade(OP_COLORS.get(o, "#444444"), max(c, 0), chunks)) < 0.5
                         for o, c in zip(op_col, chunk_col)], dtype=bool)
        fits = _label_boxes(fig, ax, starts, durs, rank_col, compute["microbatch"].to_numpy(int),
                            dark, bar_top, bar_h)
        _note_unlabelled_ranks(ax, durs, rank_col, fits, span, bar_top, bar_h, unitless)

    handles = [Patch(color=OP_COLORS[o], label=o) for o in OP_COLORS if o in set(op_col)]
    if chunks > 1:
        handles += [Patch(color=_shade("#555555", c, chunks),
                          label=f"chunk {c}" + (" (full colour)" if c == 0 else " (lighter)"))
                    for c in range(chunks)]
    handles += [Patch(color=color, label=op) for op, color in SHARD_COLORS.items()
                if sharded.any() and op in set(op_all[sharded])]
    if comm:
        handles += [Patch(color=COMM_COLORS["SEND_F"], label="send F"),
                    Patch(color=COMM_COLORS["SEND_B"], label="send B"),
                    Patch(color=COMM_COLORS["RECV_F"], label="recv wait")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
              frameon=False)
    if title is None:
        s = result.schedule
        # vpp as a run and `pipesim simulate` count it: model parts a rank (dualpipe: 1)
        copies = " (and a copy a rank)" if s is not None and s.has_copies else ""
        head = (f"{s.name}: pp={s.pp} vpp={s.parts_per_rank}{copies} m={s.num_microbatches}, "
                if s is not None else "")
        title = (f"{head}{result.source}: makespan {result.makespan:.4g}"
                 f"{' units' if unitless else ' s'}, "
                 f"bubble_fraction {result.bubble_fraction:.3f}, bubble_rate {result.bubble_rate:.3f}")
    ax.set_title(title, fontsize=10, loc="left")

    if mem_ax is not None:
        _memory_plot(result, mem_ax, t0, unitless=unitless, time_label=time_label)
    return fig


def _luminance(rgb: tuple[float, float, float]) -> float:
    return 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]


def _note_unlabelled_ranks(ax: "Axes", durs, ranks, fits, span: float, bar_top: float,
                           bar_h: float, unitless: bool) -> None:
    """A rank whose computations are all too short to label (e.g. a stage holding only the
    embedding or the head) gets a note in its row: how many, and how long each is."""
    for r in sorted(set(ranks.tolist())):
        mine = ranks == r
        if fits[mine].any():
            continue
        d = float(np.median(durs[mine]))
        each = (f"{d:.3g} units" if unitless else
                f"{d * 1e6:.0f} µs" if d < 1e-3 else f"{d * 1e3:.2g} ms")
        ax.text(span / 2, r + bar_top + bar_h / 2,
                f"{int(mine.sum())} computations of {each} (median) each: too short to label",
                ha="center", va="center", fontsize=7, style="italic", color="#333333",
                bbox={"facecolor": "white", "alpha": 0.7, "edgecolor": "none", "pad": 1.0},
                clip_on=True)


def _label_boxes(fig: "Figure", ax: "Axes", starts, durs, ranks, mbs, dark, bar_top: float,
                 bar_h: float) -> np.ndarray:
    """Write each microbatch number centred in its box when the box is wide enough; return
    which boxes got one.

    The font is the smaller of what the row height allows and what lets the median box hold
    the widest number (75th percentile box), between 4.5 and 8 points; white text on dark boxes, black on light ones.
    """
    bbox = ax.get_window_extent()
    x0, x1 = ax.get_xlim()
    px_per_s = bbox.width / max(x1 - x0, 1e-30)
    row_px = bbox.height / max(abs(ax.get_ylim()[0] - ax.get_ylim()[1]), 1e-30)
    pt_per_px = 72 / fig.dpi
    digits = np.floor(np.log10(np.maximum(mbs, 1))).astype(int) + 1
    if len(durs) == 0:
        return np.zeros(0, dtype=bool)
    width_px = np.percentile(durs, 75) * px_per_s
    fontsize = min(row_px * bar_h * pt_per_px * 0.62,
                   (width_px - 2) / (0.62 * max(int(digits.max()), 1)) * pt_per_px)
    fontsize = float(np.clip(fontsize, 4.5, 8.0))
    char_px = 0.62 * fontsize / pt_per_px
    fits = (durs * px_per_s >= digits * char_px + 2) & (mbs >= 0)
    for x, d, r, mb, is_dark in zip(starts[fits], durs[fits], ranks[fits], mbs[fits], dark[fits]):
        ax.text(x + d / 2, r + bar_top + bar_h / 2, str(mb), ha="center", va="center",
                fontsize=fontsize, color="white" if is_dark else "black", clip_on=True)
    return fits


def _memory_plot(result: "SimResult", ax: "Axes", t0: float, *, unitless: bool = False,
                 time_label: str = "time (s)") -> None:
    from matplotlib import colormaps

    timeline = result.memory_timeline
    peak = float(timeline["bytes"].max()) if len(timeline) else 0.0
    scale, unit = (1.0, "units") if unitless else byte_unit(peak)
    cmap = colormaps["viridis"]
    ranks = result.num_ranks
    end = result.makespan
    # Events at one instant (a backward ending as the next forward starts) would draw as a
    # zero-width spike: keep each instant's final value.
    timeline = timeline.drop_duplicates(["rank", "time"], keep="last")
    for r in range(ranks):
        rows = timeline[timeline["rank"] == r]
        x = np.append(rows["time"].to_numpy(float) - t0, end)
        y = np.append(rows["bytes"].to_numpy(float), rows["bytes"].to_numpy(float)[-1:] if len(rows) else 0)
        ax.step(x, y / scale, where="post", color=cmap(r / max(ranks - 1, 1)), linewidth=1.0,
                label=f"rank {r}" if ranks <= 8 else None)
    ax.set_ylabel(f"memory ({unit})", fontsize=8)
    ax.set_xlabel(time_label)
    ax.tick_params(labelsize=8)
    if ranks <= 8:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    else:
        ax.text(1.005, 1.0, f"ranks 0..{ranks - 1}\ndark -> light", transform=ax.transAxes,
                fontsize=7, va="top")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
