"""`Measurement`: what profiling adds to a run's plan, read from its ``.meta.json`` as typed
fields.

A measured run's ``.meta.json`` is flat: the `RunPlan` keys (`pipeexec.analysis.run_plan`) and,
beside them, these: the clock offsets and round trips of each pipeline rank (rank 0's clock),
the profiled step range, what the ``mem_*`` columns measure, and each stage's I/W split probe
(`pipeexec.measuring.probe`). Every key is optional on reading: files written before a key
existed load with its default. Torch-free.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# the meta keys this value reads and writes
KEYS = ("clock_offsets", "clock_rtts", "profiled_steps", "memory", "split_probe")


@dataclass(frozen=True)
class StageProbe:
    """One stage's backward timed whole (B) and split (I, then W), medians over repeats:
    seconds per op on the wall clock and the thread's CPU clock (NaN on a GPU), their ratios
    to B, and the activation bytes I released (None in probes recorded before that)."""

    wall: Mapping[str, float] = field(default_factory=dict)
    cpu: Mapping[str, float] = field(default_factory=dict)
    ratio_wall: Mapping[str, float] = field(default_factory=dict)
    ratio_cpu: Mapping[str, float] = field(default_factory=dict)
    freed_at_I: float | None = None

    def ratios(self, clock: str = "wall") -> tuple[float, float]:
        """(I/B, W/B) on ``clock`` ("wall" or "cpu"); NaN where the probe has none."""
        r = self.ratio_wall if clock == "wall" else self.ratio_cpu
        return float(r.get("I", math.nan)), float(r.get("W", math.nan))

    @classmethod
    def from_meta(cls, data: Mapping[str, Any]) -> "StageProbe":
        freed = data.get("freed_at_I")
        return cls(**{k: dict(data.get(k) or {}) for k in ("wall", "cpu", "ratio_wall",
                                                          "ratio_cpu")},
                   freed_at_I=None if freed is None else float(freed))

    def to_meta(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: dict(getattr(self, k)) for k in ("wall", "cpu", "ratio_wall",
                                                                   "ratio_cpu")}
        if self.freed_at_I is not None:
            out["freed_at_I"] = self.freed_at_I
        return out


@dataclass(frozen=True)
class Measurement:
    """What the profiler recorded besides the trace. ``split_probe``: stage -> its probe
    (empty when the run was not probed); ``memory``: what the trace's ``mem_*`` columns
    measure (``held_tensors``), None when not recorded."""

    clock_offsets: tuple[float, ...] = ()
    clock_rtts: tuple[float, ...] = ()
    profiled_steps: tuple[int, int] | None = None       # steps first..stop-1
    memory: str | None = None
    split_probe: Mapping[int, StageProbe] = field(default_factory=dict)

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> "Measurement":
        """The measurement keys of a run's meta (absent keys: the defaults)."""
        steps = meta.get("profiled_steps")
        return cls(clock_offsets=tuple(float(x) for x in meta.get("clock_offsets") or ()),
                   clock_rtts=tuple(float(x) for x in meta.get("clock_rtts") or ()),
                   profiled_steps=None if steps is None else (int(steps[0]), int(steps[1])),
                   memory=meta.get("memory"),
                   split_probe={int(s): StageProbe.from_meta(p)
                                for s, p in (meta.get("split_probe") or {}).items()})

    def to_meta(self) -> dict[str, Any]:
        """The flat meta keys (JSON-ready, stage keys as strings) of the fields recorded, as
        runs have always been written."""
        out: dict[str, Any] = {}
        if self.clock_offsets or self.clock_rtts:
            out.update(clock_offsets=list(self.clock_offsets), clock_rtts=list(self.clock_rtts))
        if self.profiled_steps is not None:
            out["profiled_steps"] = list(self.profiled_steps)
        if self.memory is not None:
            out["memory"] = self.memory
        if self.split_probe:
            out["split_probe"] = {str(s): p.to_meta() for s, p in sorted(self.split_probe.items())}
        return out
