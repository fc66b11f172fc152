"""How many CPUs a rank may use, and a quota per rank for local runs (Linux cgroups).

Why: a pipeline gives every rank its own device. A CPU run with more ranks than cores does not:
its ranks time-share the cores, and an action's duration then depends on what the other ranks
do at that moment (on a 2-core machine with 4 ranks, the same B takes 45 ms or 84 ms depending
on whether the rank sharing its core computes too). Two things follow:

* `cpu_limit` says how many CPUs this process may use (its affinity, capped by the CPU quota of
  its cgroup and every ancestor). The profiler records it per rank, so a prediction knows
  whether the calibration run's ranks shared cores (`pipeexec.analysis.contention`).
* `RankQuotas` gives each local worker its own cgroup with a CPU quota (e.g. 0.5 CPU each for 4
  ranks on 2 cores): every rank then runs at the same speed whatever the others do, as on a
  machine with one (slower) device per rank. ``launch(..., cpus_per_rank=x)`` and
  ``pipeexec train --cpus-per-rank x`` use it. It needs write access to the cgroup CPU
  controller (v1 ``cpu`` or v2 ``cpu.max``); without it, `QuotaUnavailable` says why before
  any worker starts.
"""
from __future__ import annotations

import math
import os
import secrets
from pathlib import Path

# Quota period: a rank idle for part of a period may run at full speed for the rest of it, so
# the shorter the period, the closer the quota is to a steady rate (2 ms gave the steadiest
# steps of 2, 4 and 20 ms on the development machine; the kernel's smallest quota is 1 ms).
PERIOD_US = 2000


class QuotaUnavailable(OSError):
    """This machine does not let us set per-rank CPU quotas (no writable cgroup CPU controller)."""


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, filesystem type, super options) of the cgroup mounts."""
    out = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            out.append((fields[4], tail[0], set(tail[2].split(","))))
    return out


def _own_cgroups() -> dict[str, str]:
    """Controller (or "" for v2) -> this process's cgroup path, from /proc/self/cgroup."""
    out: dict[str, str] = {}
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3:
            for ctrl in parts[1].split(",") if parts[1] else [""]:
                out[ctrl] = parts[2]
    return out


def _cpu_dir() -> tuple[Path, str, Path] | None:
    """This process's cgroup directory for the CPU controller, its version ("v1"/"v2") and the
    hierarchy's mount point (the top of the ancestors whose quotas apply)."""
    own = _own_cgroups()
    for mount, fstype, opts in _mounts():
        if fstype == "cgroup" and "cpu" in opts and "cpu" in own:
            return Path(mount + own["cpu"].rstrip("/")), "v1", Path(mount)
    for mount, fstype, _ in _mounts():
        if fstype == "cgroup2" and "" in own:
            path = Path(mount + own[""].rstrip("/"))
            try:
                if "cpu" in (path / "cgroup.controllers").read_text().split():
                    return path, "v2", Path(mount)
            except OSError:
                continue
    return None


def _quota(path: Path, version: str) -> float:
    """CPUs allowed by the quota set on ``path`` itself (inf when none or unreadable)."""
    try:
        if version == "v1":
            quota = int((path / "cpu.cfs_quota_us").read_text())
            period = int((path / "cpu.cfs_period_us").read_text())
        else:
            text = (path / "cpu.max").read_text().split()
            if text[0] == "max":
                return math.inf
            quota, period = int(text[0]), int(text[1])
    except (OSError, ValueError, IndexError):
        return math.inf
    return quota / period if quota > 0 and period > 0 else math.inf


def cpu_limit() -> float:
    """CPUs this process may use: its CPU affinity, capped by the quota of its cgroup and of
    every ancestor (a container's limit, a `RankQuotas` rank)."""
    try:
        limit = float(len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        limit = float(os.cpu_count() or 1)
    found = _cpu_dir()
    if found is None:
        return limit
    path, version, root = found
    while True:
        limit = min(limit, _quota(path, version))
        if path == root or path.parent == path:
            return limit
        path = path.parent


class RankQuotas:
    """One cgroup per local rank, each limited to ``cpus`` CPUs (see the module docstring).

    The launcher creates it before forking (`QuotaUnavailable` if it cannot), each worker calls
    ``join(rank)`` first thing, and the launcher calls ``close()`` once they have all exited,
    which removes the cgroups.
    """

    def __init__(self, nproc: int, cpus: float) -> None:
        if not (isinstance(cpus, (int, float)) and cpus > 0 and math.isfinite(cpus)):
            raise ValueError(f"cpus_per_rank must be a positive number, got {cpus!r}")
        found = _cpu_dir()
        if found is None:
            raise QuotaUnavailable("cpus_per_rank: no cgroup CPU controller for this process "
                                   "(/proc/self/cgroup, /proc/self/mountinfo)")
        base, self.version, _ = found
        self.cpus = float(cpus)
        self.root = base / f"pipeexec-{os.getpid()}-{secrets.token_hex(3)}"
        self.dirs: list[Path] = []
        # The kernel's smallest quota is 1 ms: a small share gets a longer period instead.
        period = max(PERIOD_US, math.ceil(1000 / cpus))
        quota = int(round(cpus * period))
        try:
            self.root.mkdir()
            if self.version == "v2":
                (self.root / "cgroup.subtree_control").write_text("+cpu")
            for r in range(nproc):
                d = self.root / f"rank{r}"
                d.mkdir()
                self.dirs.append(d)
                if self.version == "v1":
                    (d / "cpu.cfs_period_us").write_text(str(period))
                    (d / "cpu.cfs_quota_us").write_text(str(quota))
                else:
                    (d / "cpu.max").write_text(f"{quota} {period}")
        except OSError as exc:
            self.close()
            raise QuotaUnavailable(f"cpus_per_rank: cannot set a CPU quota under {base} "
                                   f"({exc}); it needs write access to the cgroup CPU "
                                   "controller (root, or a delegated cgroup)") from exc

    def join(self, rank: int) -> None:
        """Move the calling process (and the threads it starts later) into rank's cgroup."""
        (self.dirs[rank] / "cgroup.procs").write_text(str(os.getpid()))

    def close(self) -> None:
        """Remove the cgroups (their processes must have exited); never raises."""
        for d in [*reversed(self.dirs), self.root]:
            try:
                d.rmdir()
            except OSError:
                pass
        self.dirs = []


def quotas_available() -> bool:
    """Whether `RankQuotas` can be created here (tries one, removes it)."""
    try:
        RankQuotas(1, 0.5).close()
    except QuotaUnavailable:
        return False
    return True
