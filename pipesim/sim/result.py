"""`SimResult`: a trace plus everything derived from it, for simulated and measured runs alike.

Everything here is computed from the trace (and, for memory, either a measured memory timeline
or a :class:`CostModel` replayed over the trace), so ``SimResult.from_trace(measured)`` gives
the same metrics, Gantt chart and Chrome trace as a simulation. A simulated result holds the
engine's :class:`pipesim.sim.spans.Spans` and builds its trace DataFrame only when first read;
``makespan``, ``busy``, ``span``, the bubble metrics and peak memory read the same arrays
without it. Metric definitions are in
:mod:`pipesim.sim.metrics`; the memory model in :mod:`pipesim.sim.memory`.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import metrics
from .chrome import chrome_trace, write_chrome_trace
from .memory import compute_rows, memory_events, peak_per_rank
from .plot import gantt as plot_gantt
from .trace import check_trace, num_ranks
from ..units import byte_unit, format_number

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

    from ..plan.costs import CostModel
    from ..schedule.schedule import Schedule
    from .spans import Spans


class cached_property:
    """:func:`functools.cached_property` as Python 3.12 has it: the value is computed on first
    read and kept in the instance's ``__dict__``, with no lock (3.10 and 3.11 take one on every
    first read, a tenth of the time metrics of a small schedule)."""

    def __init__(self, func: Any) -> None:
        self.func, self.name, self.__doc__ = func, func.__name__, func.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        value = instance.__dict__[self.name] = self.func(instance)
        return value


class SimResult:
    """One step: ``trace`` (pandas DataFrame, columns in :mod:`pipesim.sim.trace`) and its metrics.

    Per-rank values are lists indexed by rank. Memory needs either ``memory_timeline`` (columns
    rank, time, bytes; e.g. measured) or ``costs`` (the memory model replayed over the trace);
    asking for memory with neither raises ValueError.
    """

    def __init__(self, trace: "pd.DataFrame", *, schedule: "Schedule | None" = None,
                 costs: "CostModel | None" = None, memory_timeline: "pd.DataFrame | None" = None,
                 options: dict[str, Any] | None = None, source: str = "simulated") -> None:
        self.trace = check_trace(trace)
        self._setup(None, schedule, costs, memory_timeline, dict(options or {}), source,
                    schedule.pp if schedule is not None else num_ranks(trace), None)

    def _setup(self, spans, schedule, costs, memory_timeline, options, source, ranks,
               times) -> None:
        # attribute stores, no __dict__ made (a small simulation's result is made in
        # microseconds); ``times``: a small run's (makespan, busy, span), set as their cached
        # properties would set them
        self._spans, self.schedule, self.costs, self.options = spans, schedule, costs, options
        self.source, self._memory_timeline, self.num_ranks = source, memory_timeline, ranks
        if times is not None:
            self.makespan, self.busy, self.span = times

    @classmethod
    def from_spans(cls, spans: "Spans", *, schedule: "Schedule", costs: "CostModel | None" = None,
                   options: dict[str, Any] | None = None) -> "SimResult":
        """A simulated result over the engine's arrays; ``trace`` is built on first access.
        ``options`` is kept as given, not copied: the engine makes a new dict a run."""
        result = cls.__new__(cls)
        pp = schedule.pp
        result._setup(spans, schedule, costs, None, {} if options is None else options,
                      "simulated", pp, spans.small_times(pp))
        return result

    @cached_property
    def trace(self) -> "pd.DataFrame":
        """One row per span (columns in :mod:`pipesim.sim.trace`); built from the spans once."""
        return check_trace(self._spans.frame())

    @cached_property
    def _compute_spans(self):
        """(rank, start, end) arrays of the compute rows of a trace (see
        :func:`metrics.compute_spans`)."""
        return metrics.compute_spans(self.trace)

    @classmethod
    def from_trace(cls, trace: "pd.DataFrame", schedule: "Schedule | None" = None,
                   memory_timeline: "pd.DataFrame | None" = None, costs: "CostModel | None" = None,
                   source: str = "measured") -> "SimResult":
        """Wrap a trace from anywhere (e.g. the executor's measured one) to score and draw it."""
        if memory_timeline is not None:
            missing = {"rank", "time", "bytes"} - set(memory_timeline.columns)
            if missing:
                raise ValueError(f"memory_timeline is missing column(s) {', '.join(sorted(missing))}")
        return cls(trace, schedule=schedule, costs=costs, memory_timeline=memory_timeline,
                   source=source)

    # -- time --------------------------------------------------------------------------------
    @cached_property
    def makespan(self) -> float:
        if self._spans is not None:
            return self._spans.makespan()
        return metrics.makespan(self.trace)

    @cached_property
    def rank_end(self) -> list[float]:
        """When each rank's last row ends (0 for a rank without rows)."""
        if self._spans is not None:
            return self._spans.rank_end(self.num_ranks)
        ends = self.trace.groupby("rank", observed=True)["end"].max()
        return [float(ends.get(r, 0.0)) for r in range(self.num_ranks)]

    @cached_property
    def busy(self) -> list[float]:
        if self._spans is not None:
            return self._spans.busy(self.num_ranks)
        return metrics.busy_of(*self._compute_spans, self.num_ranks)

    @property
    def idle(self) -> list[float]:
        return [self.makespan - b for b in self.busy]

    @cached_property
    def span(self) -> list[float]:
        if self._spans is not None:
            return self._spans.span(self.num_ranks)
        return metrics.span_of(*self._compute_spans, self.num_ranks)

    @property
    def bubble(self) -> list[float]:
        return [s - b for b, s in zip(self.busy, self.span)]

    @cached_property
    def comm_wait(self) -> list[float]:
        return metrics.comm_wait_per_rank(self.trace, self.num_ranks)

    @property
    def bubble_fraction(self) -> float:
        """Megatron's: ``(makespan - max busy) / max busy`` (see :mod:`pipesim.sim.metrics`)."""
        ideal = max(self.busy)
        if ideal <= 0:
            raise ValueError("bubble_fraction: the trace has no compute time")
        return (self.makespan - ideal) / ideal

    @property
    def slowest_rank(self) -> int:
        return metrics.slowest_of(self.busy, self.span)

    @property
    def bubble_rate(self) -> float:
        """Zero Bubble paper's: ``1 - busy/span`` of the slowest rank, over its own span."""
        busy, span = self.busy, self.span       # read once (slowest_rank reads them too)
        r = metrics.slowest_of(busy, span)      # slowest_rank, without a second property call
        return 1.0 - busy[r] / span[r] if span[r] > 0 else 0.0

    @property
    def bubble_time(self) -> float:
        """Idle seconds inside the slowest rank's own span (``bubble[slowest_rank]``)."""
        return self.bubble[self.slowest_rank]

    # -- memory --------------------------------------------------------------------------------
    @cached_property
    def memory_timeline(self) -> "pd.DataFrame":
        """Columns rank, time, bytes (held after each event)."""
        if self._memory_timeline is not None:
            return self._memory_timeline
        return self._memory_events.frame()

    @cached_property
    def _memory_events(self):
        """The memory model replayed over the compute rows (the engine's arrays when there)."""
        if self.costs is None:
            raise ValueError("memory needs a memory_timeline or a CostModel: pass costs= or "
                             "memory_timeline= to SimResult.from_trace")
        n = self.schedule.num_stages if self.schedule is not None else int(self.trace["stage"].max()) + 1
        stages = ([self.schedule.rank_stages(r) for r in range(self.num_ranks)]
                  if self.schedule is not None else None)
        if self._spans is not None:
            rows, t0 = self._spans.memory_rows(), float(self._spans.starts.min())
        else:
            rows, t0 = compute_rows(self.trace), float(self.trace["start"].min())
        return memory_events(rows, t0, self.costs, n, self.num_ranks, stages, self.schedule)

    @cached_property
    def peak_memory(self) -> list[float]:
        if self._memory_timeline is not None:
            return peak_per_rank(self._memory_timeline, self.num_ranks)
        return self._memory_events.peaks(self.num_ranks)

    @cached_property
    def peak_inflight(self) -> list[int]:
        """Most (stage, microbatch) pairs holding activations at once, per rank, all chunks."""
        return metrics.peak_inflight_per_rank(self.trace, self.num_ranks)

    # -- tables and pictures -------------------------------------------------------------------
    def _has_memory(self) -> bool:
        return self._memory_timeline is not None or self.costs is not None

    def summary(self) -> "pd.DataFrame":
        """One row per rank (busy, idle, comm_wait, bubble, peak memory and in-flight) and a
        final row "all" with the step's makespan, bubble_fraction and bubble_rate."""
        import pandas as pd

        rows = []
        for r in range(self.num_ranks):
            row = {"rank": str(r), "busy": self.busy[r], "idle": self.idle[r],
                   "comm_wait": self.comm_wait[r], "bubble": self.bubble[r],
                   "peak_inflight": self.peak_inflight[r]}
            if self._has_memory():
                row["peak_memory"] = self.peak_memory[r]
            rows.append(row)
        total = {"rank": "all", "busy": max(self.busy), "idle": max(self.idle),
                 "comm_wait": max(self.comm_wait), "bubble": self.bubble_time,
                 "peak_inflight": max(self.peak_inflight)}
        if self._has_memory():
            total["peak_memory"] = max(self.peak_memory)
        rows.append(total)
        frame = pd.DataFrame(rows).set_index("rank")
        frame.attrs.update(makespan=self.makespan, bubble_fraction=self.bubble_fraction,
                           bubble_rate=self.bubble_rate)
        return frame

    def summary_text(self, unitless: bool = False) -> str:
        """The summary table with a header naming the schedule and both bubble metrics.

        Times are seconds and memory is shown in GiB or MiB; ``unitless``: the costs are unit
        counts (``CostModel.uniform``), so both are plain numbers of "units"."""
        head = []
        if self.schedule is not None:
            s = self.schedule
            layout = (f"vpp={s.parts_per_rank} ({s.vpp} stages a rank: its part and a copy of "
                      f"another)" if s.has_copies else f"vpp={s.vpp}")
            head.append(f"{s.name}: pp={s.pp} {layout} microbatches={s.num_microbatches} "
                        f"({self.source})")
        unit = "units" if unitless else "s"
        head.append(f"makespan {self.makespan:.6g} {unit}   bubble_fraction (Megatron, idle/ideal) "
                    f"{self.bubble_fraction:.4f}   bubble_rate (ZB, 1-busy/span of rank "
                    f"{self.slowest_rank}) {self.bubble_rate:.4f}")
        frame = self.summary()
        if unitless:
            head.append("(unitless costs: times and memory in units of the cost model)")
        else:
            if "peak_memory" in frame.columns:
                scale, name = byte_unit(float(frame["peak_memory"].max()))
                frame = frame.rename(columns={"peak_memory": f"peak_memory_{name}"})
                frame[f"peak_memory_{name}"] = frame[f"peak_memory_{name}"] / scale
            head.append("(times in seconds)")
        # idle time of a rank that never waits is makespan - busy: rounding noise, shown as 0
        noise = 1e-9 * abs(self.makespan)
        table = frame.to_string(float_format=lambda x: format_number(x, zero_below=noise))
        return "\n".join(head) + "\n" + table

    def gantt(self, **kwargs: Any) -> "Figure":
        """A Gantt chart; options in :func:`pipesim.sim.plot.gantt`."""
        return plot_gantt(self, **kwargs)

    def to_chrome_trace(self, path: str | Path | None = None) -> dict:
        """Chrome / Perfetto trace JSON (see :mod:`pipesim.sim.chrome`); written to ``path`` if given."""
        data = chrome_trace(self.trace)
        if path is not None:
            write_chrome_trace(data, path)
        return data

    def __repr__(self) -> str:
        name = self.schedule.name if self.schedule is not None else "trace"
        return (f"SimResult({name!r}, {self.source}, makespan={self.makespan:.6g}, "
                f"bubble_fraction={self.bubble_fraction:.4f}, bubble_rate={self.bubble_rate:.4f})")

