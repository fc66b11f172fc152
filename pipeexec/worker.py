"""What one training process does: topology, trainer, loop, metrics, teardown.

Shared by both launch paths: torchrun calls it directly in every process, the local launcher
calls it in every forked worker (with the shared `ActionBoard`).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from .board import ActionBoard
from .config import TrainConfig
from .topology import destroy_topology, init_topology
from .train import Trainer, train


def _log(msg: str) -> None:
    print(msg, file=sys.stdout, flush=True)


def run_training(board: ActionBoard | None, config: TrainConfig, metrics_out: str | None = None,
                 progress: bool = True) -> dict:
    """Train per ``config`` in this process (one rank); return (and on rank 0 write) metrics."""
    topology = init_topology(config.pp, config.dp, backend=config.backend, device=config.device,
                             timeout=config.collective_timeout)
    try:
        trainer = Trainer(config, topology, board=board)
        if topology.rank == 0:
            _log(f"pipeexec: {config.schedule} pp={config.pp} vpp={config.vpp} dp={config.dp} "
                 f"m={config.microbatches} b={config.micro_batch_size} precision={config.precision} "
                 f"layers={config.layers}+2 hidden={config.hidden} on {topology.backend}/"
                 f"{topology.device.type}; stage bounds {list(trainer.bounds)}")
        result = train(trainer, log=_log, progress=progress)
        metrics = result.to_dict()
        metrics.update(config=config.to_dict(), world_size=topology.world_size,
                       backend=topology.backend, device=str(topology.device))
        if topology.rank == 0 and metrics_out:
            path = Path(metrics_out)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(metrics, indent=1))
            tmp.replace(path)
        return metrics
    finally:
        destroy_topology(topology)
