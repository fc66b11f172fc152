"""A schedule's action lists as a rank-by-step grid, the failing step marked: what a
:class:`pipesim.ScheduleError` shows under its message (in the manner of
torch.distributed.pipelining's ``_format_pipeline_order(..., error_step_number)``)."""
from __future__ import annotations

from collections.abc import Collection, Sequence


def format_grid(lists: Sequence[Sequence[object]], step: int | None = None,
                rank: int | None = None, marks: Collection[tuple[int, int]] = (),
                window: int = 4) -> str:
    """Rows ``Step k``, one column per rank, of ``lists[rank][k]``; the row ``step`` ends with
    ``<-- rank R fails here`` and the cells in ``marks`` ((rank, step) pairs, and (rank, step))
    are bracketed. With ``step``, only ``window`` steps either side of it are shown (the rest
    elided), so a long schedule's error stays readable."""
    pp = len(lists)
    steps = max((len(a) for a in lists), default=0)
    marked = set(marks)
    if step is not None and rank is not None:
        marked.add((rank, step))
    shown = range(steps)
    if step is not None:
        focus = [step] + [s for _, s in marked]
        shown = range(max(0, min(focus) - window), min(steps, max(focus) + window + 1))
    label_width = len(f"Step {max(steps - 1, 0)}")

    def cell(r: int, k: int) -> str:
        text = str(lists[r][k]) if k < len(lists[r]) else ""
        return f"[{text}]" if (r, k) in marked else text

    cells = {(r, k): cell(r, k) for r in range(pp) for k in shown}
    widths = [max([len(f"Rank {r}")] + [len(cells[r, k]) for k in shown]) for r in range(pp)]
    lines = [" " * (label_width + 2) + " ".join(f"{f'Rank {r}':<{widths[r]}}" for r in range(pp))]
    if shown and shown.start > 0:
        lines.append(f"{'...':<{label_width}}  ({shown.start} earlier steps)")
    for k in shown:
        row = " ".join(f"{cells[r, k]:<{widths[r]}}" for r in range(pp)).rstrip()
        tail = f"  <-- rank {rank} fails here" if k == step and rank is not None else ""
        lines.append(f"{f'Step {k}':<{label_width}}: {row}{tail}")
    if shown and shown.stop < steps:
        lines.append(f"{'...':<{label_width}}  ({steps - shown.stop} later steps)")
    return "\n".join(lines)
