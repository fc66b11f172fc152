"""`ProfileOptions`: the profiling concern of a run. Its flags (``--profile A:B``,
``--trace-out``, ``--profile-align-rounds``, ``--profile-timeout``, ``--no-probe-split``) are
generated from its fields (`pipeexec.flag_fields`), with their help and defaults, as the other
sections' are. Torch-free."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

from ..flag_fields import flag_of, option, values_from_args


def parse_step_range(text: str) -> tuple[int, int]:
    """``"A:B"`` -> steps A..B-1 (a Python slice); ``"N"`` -> step N alone."""
    try:
        if ":" in text:
            a, b = text.split(":", 1)
            first, stop = int(a), int(b)
        else:
            first = int(text)
            stop = first + 1
    except ValueError:
        raise ValueError(f"--profile {text!r}: expected A:B (steps A..B-1) or N") from None
    if not 0 <= first < stop:
        raise ValueError(f"--profile {text!r}: need 0 <= A < B")
    return first, stop


@dataclass(frozen=True)
class ProfileOptions:
    """Which steps to profile (``first <= step < stop``), where to write the trace, and how the
    profiler synchronises. ``cpus_per_rank``: the CPU quota the launcher gave each rank (None:
    not confined; set from the launcher's ``--cpus-per-rank``), recorded in the run
    description."""

    first: int = option(
        1, "time every action of steps A..B-1 (or one step N) on every rank, align clocks, "
        "count activation memory, and gather one trace on rank 0 (default: no profiling)",
        flag="--profile", metavar="A:B", parse=parse_step_range, fields=("first", "stop"))
    stop: int = option(2, "the first step after the profiled ones (from --profile)", flag=None)
    trace_out: str | None = option(
        None, "with --profile: write the measured trace as Chrome/Perfetto JSON, with FILE.csv "
        "and FILE.meta.json beside it", metavar="FILE.json")
    cpus_per_rank: float | None = option(None, "the launcher's CPU quota per rank", flag=None)
    align_rounds: int = option(
        16, "with --profile: clock-alignment round trips between each rank and rank 0 at "
        "start-up (the one with the shortest round trip sets the offset)",
        flag="--profile-align-rounds", type=int, metavar="N")
    timeout: float = option(
        120.0, "with --profile: seconds a rank waits for rank 0 while aligning clocks",
        flag="--profile-timeout", type=float, metavar="S")
    probe_split: bool = option(
        True, "with --profile: do not time each stage's F, B, I and W apart after the profiled "
        "steps (the split a run without I/W gives calibration for zero-bubble schedules)",
        flag="--no-probe-split", action="store_true", invert=True)

    @classmethod
    def parse(cls, text: str, trace_out: str | None = None, *,
              cpus_per_rank: float | None = None) -> "ProfileOptions":
        first, stop = parse_step_range(text)
        return cls(first, stop, trace_out, cpus_per_rank=cpus_per_rank)

    @classmethod
    def from_args(cls, ns: argparse.Namespace, *, cpus_per_rank: float | None = None
                  ) -> "ProfileOptions | None":
        """The options the generated flags in ``ns`` give; None without ``--profile``. Raises
        ValueError naming a profiling flag given without ``--profile``, or a bad value."""
        values = values_from_args(cls, ns)
        if "first" not in values:
            defaults = cls()
            given = [flag_of(f) for f in fields(cls)
                     if f.name in values and values[f.name] != getattr(defaults, f.name)]
            if given:
                raise ValueError(f"{', '.join(given)} need{'s' if len(given) == 1 else ''} "
                                 "--profile A:B (the steps to record)")
            return None
        return cls(**values, cpus_per_rank=cpus_per_rank).validate()

    def validate(self) -> "ProfileOptions":
        """Raise ValueError naming the flag; checked before any process starts."""
        if not 0 <= self.first < self.stop:
            raise ValueError(f"--profile {self.first}:{self.stop}: need 0 <= A < B")
        if self.align_rounds < 1:
            raise ValueError(f"--profile-align-rounds must be >= 1, got {self.align_rounds}")
        if not self.timeout > 0:
            raise ValueError(f"--profile-timeout must be > 0 seconds, got {self.timeout}")
        return self

    def check(self, steps: int) -> None:
        """Raise ValueError when the range is not inside a run of ``steps`` steps."""
        if self.stop > steps:
            raise ValueError(f"--profile {self.first}:{self.stop} reaches past the run's "
                             f"{steps} step(s) (steps are numbered from 0)")

    def replace(self, **changes: Any) -> "ProfileOptions":
        from dataclasses import replace

        return replace(self, **changes)
