"""Two schedules in one job, alternating steps: a calibration and its target measured on the
same machine seconds apart.

On a shared machine two jobs a minute apart can differ by 10-20% in step time (other processes,
page cache, frequency): a prediction calibrated on one job and checked against another measures
that drift as much as the simulator. `paired_runs` trains every config in the same worker
processes, one step of each in turn, each profiled by its own session, so the calibration
steps and the measured steps meet the same machine. Every config must have the same pp and dp
(they share the processes and the process groups).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..analysis.measured_run import MeasuredRun
from ..config import TrainConfig
from ..launching.launcher import launch
from ..measuring.profile_options import ProfileOptions
from ..measuring.session import ProfileSession
from ..models import worker_modules
from ..topology import destroy_topology, init_topology
from .assemble import assemble_prepared
from .prepare import PreparedRun, prepare


@dataclass(frozen=True)
class PairedJob:
    """What every rank of a paired job is given: the runs trained in turn (validated before
    launch), the profiled
    steps ``first..stop-1``, each config's trace file (or None), the CPU share of each rank
    and the other profiling options (default `ProfileOptions`' defaults)."""

    runs: tuple[PreparedRun, ...]
    first: int
    stop: int
    trace_outs: tuple[str | None, ...]
    cpus_per_rank: float | None = None
    profile: ProfileOptions | None = None


def paired_worker(board: Any, job: PairedJob) -> list[MeasuredRun | None]:
    """One rank of a paired job; returns (on rank 0) one `MeasuredRun` per config."""
    cfg0 = job.runs[0].config
    par, runtime = cfg0.plan.parallelism, cfg0.runtime
    topo = init_topology(par.pp, par.dp, tp=par.tp, cp=par.cp, ep=par.ep, backend=runtime.backend,
                         device=runtime.device, timeout=runtime.collective_timeout)
    try:
        pairs = []
        for run, out in zip(job.runs, job.trace_outs):
            options = (job.profile or ProfileOptions()).replace(
                first=job.first, stop=job.stop, trace_out=out, cpus_per_rank=job.cpus_per_rank)
            session = ProfileSession(options, topo)
            trainer = assemble_prepared(run, topo, board=board, recorder=session.profiler)
            session.attach(trainer)
            pairs.append((session, trainer))
        for _ in range(cfg0.optimizer.steps):
            for _, trainer in pairs:
                trainer.step()
        return [session.finish(trainer) for session, trainer in pairs]
    finally:
        destroy_topology(topo)


def _shared(config: TrainConfig) -> dict[str, Any]:
    """What configs trained in one job must agree on: the process layout, the steps and the
    transports."""
    par, runtime = config.plan.parallelism, config.runtime
    return {"tp": par.tp, "cp": par.cp, "ep": par.ep, "pp": par.pp, "dp": par.dp,
            "steps": config.optimizer.steps, "backend": runtime.backend, "device": runtime.device}


def paired_runs(configs: Sequence[TrainConfig], first: int, stop: int, *,
                trace_outs: Sequence[str | None] | None = None, timeout: float | None = None,
                cpus_per_rank: float | None = None, profile: ProfileOptions | None = None
                ) -> list[MeasuredRun]:
    """Train ``configs`` side by side in one job of local workers, alternating steps, each
    profiling steps ``first..stop-1``; return their measured runs (written to ``trace_outs``
    where given). ``profile``: the other `ProfileOptions` (clock alignment, split probe).
    Raises ValueError when the configs cannot share processes."""
    configs = list(configs)
    base = configs[0]
    for c in configs[1:]:
        ours, theirs = _shared(base), _shared(c)
        for name in ours:
            if ours[name] != theirs[name]:
                raise ValueError(f"paired runs share their processes: {name} must be equal, got "
                                 f"{ours[name]!r} ({base.plan.schedule_name}) and "
                                 f"{theirs[name]!r} ({c.plan.schedule_name})")
    outs = tuple(trace_outs) if trace_outs is not None else (None,) * len(configs)
    runs = tuple(prepare(c, world_size=base.world_size) for c in configs)
    job = PairedJob(runs, first, stop, outs, cpus_per_rank, profile)
    preload = tuple(dict.fromkeys(m for c in configs for m in worker_modules(c)))
    runs = launch(paired_worker, base.world_size, (job,), timeout=timeout,
                  cpus_per_rank=cpus_per_rank, preload=preload)[0]
    if runs is None or any(r is None for r in runs):
        raise RuntimeError("rank 0 returned no measured runs (was the profiled range empty?)")
    return runs
