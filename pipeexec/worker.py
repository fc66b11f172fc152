"""What one training process does: topology, trainer, loop, metrics, teardown.

Shared by both launch paths: torchrun calls it directly in every process, the local launcher
calls it in every forked worker (with the shared `ActionBoard`).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from .board import ActionBoard
from .checkpoint import CheckpointManager, CheckpointOptions
from .config import TrainConfig
from .topology import destroy_topology, init_topology
from .train import Trainer, train
from .versions import run_versions

if TYPE_CHECKING:
    from .profile import ProfileOptions


def _log(msg: str) -> None:
    print(msg, file=sys.stdout, flush=True)


def run_training(board: ActionBoard | None, config: TrainConfig, metrics_out: str | None = None,
                 progress: bool = True, checkpoint: CheckpointOptions | None = None,
                 profile: "ProfileOptions | None" = None) -> dict:
    """Train per ``config`` in this process (one rank); return (and on rank 0 write) metrics.

    ``checkpoint``: load before the loop and save from it (``--load``, ``--save`` ...).
    ``profile``: time the actions of a step range (``--profile A:B``); rank 0's metrics then
    hold the gathered `MeasuredRun` under "measured_run" (not written to ``metrics_out``)."""
    topology = init_topology(config.pp, config.dp, backend=config.backend, device=config.device,
                             timeout=config.collective_timeout, p2p_timeout=config.p2p_timeout)
    try:
        session = None
        if profile is not None:
            from .profile import ProfileSession
            session = ProfileSession(profile, topology)
        trainer = Trainer(config, topology, board=board,
                          recorder=None if session is None else session.profiler)
        if session is not None:
            session.attach(trainer)
        if topology.rank == 0:
            _log(f"pipeexec: {config.schedule} pp={config.pp} vpp={config.vpp} dp={config.dp} "
                 f"m={config.microbatches} b={config.micro_batch_size} precision={config.precision} "
                 f"layers={config.layers}+2 hidden={config.hidden} on {topology.backend}/"
                 f"{topology.device.type}; stage bounds {list(trainer.bounds)}")
            v = run_versions(topology.backend)
            _log(f"pipeexec: torch {v['torch']}" + (f", NCCL {v['nccl']}" if v["nccl"] else "")
                 + ("" if v["torch_supported"] or topology.backend != "nccl" else
                    " (outside the torch range the NCCL path supports: pipeexec/versions.py)"))
        manager = CheckpointManager(checkpoint, log=_log) if checkpoint and checkpoint.active else None
        if manager is not None:
            manager.load(trainer)
        result = train(trainer, log=_log, progress=progress,
                       on_step=None if manager is None else manager.on_step)
        if manager is not None:
            manager.finish(trainer)
        metrics = result.to_dict()
        if manager is not None:
            metrics["checkpoint"] = manager.metrics()
        metrics.update(config=config.to_dict(), world_size=topology.world_size,
                       backend=topology.backend, device=str(topology.device),
                       versions=run_versions(topology.backend))
        measured = session.finish(trainer) if session is not None else None
        if measured is not None:
            metrics["profile"] = {"steps": measured.steps, "makespans": measured.makespans(),
                                  "trace_out": profile.trace_out}
        if topology.rank == 0 and metrics_out:
            path = Path(metrics_out)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(metrics, indent=1))
            tmp.replace(path)
        if measured is not None:
            metrics["measured_run"] = measured
        if topology.world_size > 1:
            dist.barrier()      # no rank tears its groups down while a peer still uses them
        return metrics
    finally:
        destroy_topology(topology)
