"""`RunPlan`: what a measured run was, as a torch-free value.

A measured run (and a checkpoint) must say exactly what ran, so that calibration, prediction,
comparison and a resume rebuild it rather than guess it from names: the schedule *as data*
(`pipesim.schedule.io`'s JSON, so a hand-made or searched schedule comes back as itself, not as
the builder its name happens to match), the stage partition (``bounds``), the kind of every
layer (layers of one kind are assumed to cost the same when costs are re-partitioned), the
hosts the ranks ran on with their CPUs and the CPU share each rank had, and the run's config.

It is stored flat in a measured run's ``.meta.json`` (``to_meta`` / ``from_meta``; the keys the
files had before this value existed, plus ``schedule_data``), so files written earlier still
load (their schedule rebuilt from its name). Imports neither torch nor anything that does.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pipesim
from pipesim.schedule.io import schedule_from_dict, schedule_to_dict


@dataclass(frozen=True)
class Layout:
    """How a run's layers are cut: ``bounds`` (one more layer index than model parts) and the
    kind of every layer. ``stage_parts``: the part each schedule stage computes, when stages
    are copies of parts (dualpipe); by default stage = part."""

    bounds: tuple[int, ...]
    layer_kinds: tuple[str, ...]
    stage_parts: tuple[int, ...] | None = None

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1 if self.stage_parts is None else len(self.stage_parts)

    def counts(self, kinds: Sequence[str]):
        """Matrix [stage, kind] of layer counts (a copy's row is its part's)."""
        import numpy as np

        a = np.zeros((self.num_stages, len(kinds)))
        col = {k: i for i, k in enumerate(kinds)}
        for s in range(self.num_stages):
            part = s if self.stage_parts is None else self.stage_parts[s]
            for layer in range(self.bounds[part], self.bounds[part + 1]):
                a[s, col[self.layer_kinds[layer]]] += 1
        return a

    @classmethod
    def of_run(cls, run: Any) -> "Layout":
        """The layout of a `MeasuredRun` (its plan's)."""
        return run.plan.layout


@dataclass(frozen=True)
class RunPlan:
    """One run's plan: schedule (a `pipesim.Schedule` value), partition, layer kinds, where the
    ranks ran. ``schedule_name``: what the run was asked for (a builder's name or a file);
    ``config``: the run's `TrainConfig` as a dict (None for runs made outside a TrainConfig)."""

    schedule: pipesim.Schedule
    bounds: tuple[int, ...]
    layer_kinds: tuple[str, ...]
    dp: int = 1
    device: str = "cpu"
    backend: str | None = None
    hosts: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    rank_cpus: tuple[float, ...] = ()
    host_cpus: int | None = None
    cpus_per_rank: float | None = None
    config: Mapping[str, Any] | None = None
    schedule_name: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "bounds", tuple(int(b) for b in self.bounds))
        object.__setattr__(self, "layer_kinds", tuple(str(k) for k in self.layer_kinds))
        object.__setattr__(self, "rank_cpus", tuple(float(c) for c in self.rank_cpus))
        if self.schedule_name is None:
            object.__setattr__(self, "schedule_name", self.schedule.name)
        n = self.schedule.num_parts        # the stages, unless some are copies of parts
        if len(self.bounds) != n + 1:
            what = "model parts" if self.schedule.has_copies else "stages"
            raise ValueError(f"run plan: bounds {list(self.bounds)} give {len(self.bounds) - 1} "
                             f"stages, the schedule {self.schedule.name!r} has {n} {what}")
        if len(self.layer_kinds) != self.bounds[-1]:
            raise ValueError(f"run plan: {len(self.layer_kinds)} layer kinds for "
                             f"{self.bounds[-1]} layers (bounds {list(self.bounds)})")

    @property
    def pp(self) -> int:
        return self.schedule.pp

    @property
    def parts_per_rank(self) -> int:
        """Model parts per rank: what the run's config and its meta call ``vpp`` (the
        schedule's stages per rank, unless stages are copies of parts: dualpipe's 1)."""
        return self.schedule.parts_per_rank

    @property
    def microbatches(self) -> int:
        return self.schedule.num_microbatches

    @property
    def num_stages(self) -> int:
        return self.schedule.num_stages

    @property
    def layout(self) -> Layout:
        return Layout(self.bounds, self.layer_kinds, self.schedule.stage_parts)

    # -- the measured run's meta JSON -----------------------------------------------------------
    def to_meta(self) -> dict[str, Any]:
        """The flat ``.meta.json`` keys of this plan (JSON-ready)."""
        s = self.schedule
        return {"schedule": self.schedule_name, "pp": s.pp, "vpp": s.parts_per_rank, "dp": self.dp,
                "microbatches": s.num_microbatches, "recv_lookahead": s.recv_lookahead,
                "bounds": list(self.bounds), "layer_kinds": list(self.layer_kinds),
                "device": self.device, "backend": self.backend,
                "rank_cpus": list(self.rank_cpus), "host_cpus": self.host_cpus,
                "cpus_per_rank": self.cpus_per_rank,
                "hosts": {h: dict(v) for h, v in self.hosts.items()},
                "config": None if self.config is None else dict(self.config),
                "schedule_data": schedule_to_dict(s)}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any], source: str = "measured run") -> "RunPlan":
        """Read the plan back from a meta dict; raises ValueError naming ``source`` and the
        key. Meta without ``schedule_data`` (older files) rebuilds the schedule from its name."""
        for key in ("schedule", "pp", "vpp", "microbatches", "bounds", "layer_kinds"):
            if key not in meta:
                raise ValueError(f"{source}: lacks {key!r}")
        schedule = schedule_from_meta(meta, source)
        return cls(schedule, tuple(meta["bounds"]), tuple(meta["layer_kinds"]),
                   dp=int(meta.get("dp", 1)), device=str(meta.get("device") or "cpu"),
                   backend=meta.get("backend"), hosts=dict(meta.get("hosts") or {}),
                   rank_cpus=tuple(meta.get("rank_cpus") or ()), host_cpus=meta.get("host_cpus"),
                   cpus_per_rank=meta.get("cpus_per_rank"), config=meta.get("config"),
                   schedule_name=str(meta["schedule"]))


def schedule_from_meta(meta: Mapping[str, Any], source: str = "measured run") -> pipesim.Schedule:
    """The schedule a run's meta records: as data (``schedule_data``), or, in files written
    before that, rebuilt from its name, pp, vpp, microbatches and receive lookahead."""
    for key in ("schedule", "pp", "vpp", "microbatches"):
        if key not in meta:
            raise ValueError(f"{source}: lacks {key!r}")
    if meta.get("schedule_data") is not None:
        schedule = schedule_from_dict(meta["schedule_data"], source=source)
    else:
        schedule = pipesim.build_schedule(meta["schedule"], pp=int(meta["pp"]),
                                          microbatches=int(meta["microbatches"]),
                                          vpp=int(meta["vpp"]),
                                          recv_lookahead=int(meta.get("recv_lookahead", 0)))
    got = (schedule.pp, schedule.parts_per_rank, schedule.num_microbatches)
    want = (int(meta["pp"]), int(meta["vpp"]), int(meta["microbatches"]))
    if got != want:
        raise ValueError(f"{source}: schedule_data has pp, vpp, microbatches = {got}, the "
                         f"meta says {want}")
    return schedule
