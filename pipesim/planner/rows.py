"""A search's rows as values: one plan's layout, what bounding or simulating it said, its figures.

The search's table (`SearchResult.rows`, written as CSV or Parquet by ``pipesim plan``) has
one column per field of these classes, in field order (`COLUMNS`), so a column cannot be added
to one place and forgotten in the other. A field left None was not computed for that plan (a
pruned plan has no step time): the table shows it as missing (NaN), as before these classes.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from ..plan.plan import Plan
from .enumerate import plan_key

# status values
SIMULATED, PRUNED_MEMORY, PRUNED_TIME, INVALID = ("simulated", "pruned: memory bound",
                                                  "pruned: step-time bound", "invalid")
CANDIDATE = ""                       # bounded, neither pruned nor simulated yet


@dataclass(frozen=True)
class PlanConfig:
    """The layout of one enumerated plan, as the table names it."""

    key: str
    schedule: str
    tp: int
    cp: int
    pp: int
    vpp: int
    dp: int
    ep: int
    ep_dispatcher: str
    mbs: int
    microbatches: int
    recompute: str
    zero: int

    @classmethod
    def of(cls, plan: Plan) -> "PlanConfig":
        p = plan.parallelism
        return cls(key=plan_key(plan), schedule=plan.schedule_name, tp=p.tp, cp=p.cp, pp=p.pp,
                   vpp=p.vpp, dp=p.dp, ep=p.ep, ep_dispatcher=p.ep_dispatcher,
                   mbs=p.micro_batch_size,
                   microbatches=p.microbatches, recompute=p.recompute, zero=p.zero)


@dataclass(frozen=True)
class PlanFigures:
    """A simulated plan's figures; memory (bytes) is the worst rank's (``peak_rank``)."""

    step_time: float
    tokens_per_s_per_gpu: float
    mfu: float
    hfu: float
    bubble_fraction: float
    bubble_rate: float
    peak_memory: float
    peak_rank: int
    headroom: float                  # the limit minus the peak
    fits: bool
    weights: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float


@dataclass(frozen=True)
class Assessment:
    """What bounding or simulating one plan said (a worker task's answer): None where it said
    nothing, so `PlanRow.merged` keeps what an earlier phase found. ``*_s``: CPU seconds spent,
    summed into the search's timing, never in the table."""

    status: str
    reason: str = ""
    step_time_bound: float | None = None
    memory_bound: float | None = None
    figures: PlanFigures | None = None
    derive_s: float = 0.0
    bound_s: float = 0.0
    sim_s: float = 0.0

    def columns(self) -> dict[str, Any]:
        """The table columns this assessment sets."""
        out: dict[str, Any] = {"status": self.status, "reason": self.reason}
        for name in ("step_time_bound", "memory_bound"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.figures is not None:
            out.update(_flat(self.figures))
        return out


@dataclass(frozen=True)
class PlanRow:
    """One row of the search's table: the layout, and what the search found out so far."""

    config: PlanConfig
    status: str | None = None
    reason: str | None = None
    step_time_bound: float | None = None
    memory_bound: float | None = None
    figures: PlanFigures | None = None

    @property
    def key(self) -> str:
        return self.config.key

    def merged(self, found: Assessment) -> "PlanRow":
        """This row with what ``found`` says (its None fields keep this row's values)."""
        return replace(self, status=found.status, reason=found.reason,
                       step_time_bound=_first(found.step_time_bound, self.step_time_bound),
                       memory_bound=_first(found.memory_bound, self.memory_bound),
                       figures=_first(found.figures, self.figures))

    def record(self) -> dict[str, Any]:
        """The row as table columns, the ones not computed left out (missing in the table)."""
        out = _flat(self.config)
        for name in ("status", "reason", "step_time_bound", "memory_bound"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.figures is not None:
            out.update(_flat(self.figures))
        return out


def _flat(value: Any) -> dict[str, Any]:
    """A dataclass of plain fields as a dict (what ``asdict`` gives for them, without its
    recursive copy: a search records a row for every plan)."""
    return {f.name: getattr(value, f.name) for f in fields(value)}


def _first(a: Any, b: Any) -> Any:
    return b if a is None else a


def _names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


CONFIG_COLUMNS = _names(PlanConfig)[1:]          # the layout, without the key
COLUMNS = (("key",) + CONFIG_COLUMNS
           + tuple(n for n in _names(PlanRow) if n not in ("config", "figures"))
           + _names(PlanFigures))
