"""What one training process does: topology, the assembled rank, loop, metrics, teardown.

Shared by both launch paths: torchrun calls it directly in every process, the local launcher
calls it in every forked worker (with the shared `ActionBoard`). In: one `WorkerArgs` value
(what every rank is given: it pickles to spawned workers as a whole, the run validated before
launch among it). Out: a `RunOutcome`.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..analysis.measured_run import MeasuredRun
from ..checkpoint import CheckpointManager, CheckpointOptions
from ..config import RESCHEDULE_WARMUP_STEPS, TrainConfig
from ..launching.board import ActionBoard
from ..measuring.profile_options import ProfileOptions
from ..measuring.reschedule import check_memory_limit
from ..measuring.session import ProfileSession
from ..topology import destroy_topology, init_topology
from ..training.metrics_log import LogOptions
from ..training.train import train
from ..training.validation import EvalOptions
from ..versions import run_versions
from .assemble import assemble_prepared
from .prepare import PreparedRun, prepare
from .zb_auto import ZbAutoSwitch, profiled_start


@dataclass(frozen=True)
class WorkerArgs:
    """What every rank of a run is given. ``metrics_out``: rank 0 writes the metrics there;
    ``checkpoint``: load before the loop and save from it (``--load``, ``--save`` ...);
    ``profile``: time the actions of a step range (``--profile A:B``); ``evaluation``: the
    validation loss (``--eval-interval``, ``--eval-only``); ``logging``: the step lines'
    interval and TensorBoard / W&B scalars (``--log-interval``, ``--tensorboard-dir``);
    ``prepared``: ``config`` as `prepare` validated it before launch, with the schedule it built
    (None: each rank prepares the run itself)."""

    config: TrainConfig
    metrics_out: str | None = None
    progress: bool = True
    checkpoint: CheckpointOptions | None = None
    profile: ProfileOptions | None = None
    evaluation: EvalOptions | None = None
    logging: LogOptions | None = None
    prepared: PreparedRun | None = None

    def __post_init__(self) -> None:
        if self.prepared is not None and self.prepared.config != self.config:
            raise ValueError("WorkerArgs: prepared is another run's (prepared.config != config)")


@dataclass(frozen=True)
class RunOutcome:
    """What one rank's run gives back: its metrics (JSON-ready: what rank 0 writes to
    ``metrics_out``) and, on rank 0 of a profiled run, the gathered `MeasuredRun` (None on
    the other ranks and in runs not profiled)."""

    metrics: dict[str, Any]
    measured: MeasuredRun | None = None


def _log(msg: str) -> None:
    print(msg, file=sys.stdout, flush=True)


def run_training(board: ActionBoard | None, args: WorkerArgs) -> RunOutcome:
    """Train per ``args.config`` in this process (one rank); return its outcome (rank 0 also
    writes the metrics to ``args.metrics_out``)."""
    if not isinstance(args, WorkerArgs):
        raise TypeError(f"run_training takes a WorkerArgs, got {type(args).__name__} (launch "
                        "it as launch(run_training, n, (WorkerArgs(config, ...),)))")
    config, metrics_out, progress = args.config, args.metrics_out, args.progress
    checkpoint, profile = args.checkpoint, args.profile
    par, runtime = config.plan.parallelism, config.runtime
    topology = init_topology(par.pp, par.dp, tp=par.tp, cp=par.cp, ep=par.ep,
                             backend=runtime.backend,
                             device=runtime.device,
                             timeout=runtime.collective_timeout, p2p_timeout=runtime.p2p_timeout)
    try:
        session = None
        auto = config.layout.memory_limit is not None   # zb-auto searched from this run's costs
        if auto and profile is not None:
            raise ValueError("--profile and zb-auto's --memory-limit both profile the run; "
                             "give one of them")
        run = args.prepared or prepare(config, world_size=topology.world_size)
        if auto:
            run = profiled_start(run)
        if profile is not None or auto:
            session = ProfileSession(profile or ProfileOptions(
                RESCHEDULE_WARMUP_STEPS, RESCHEDULE_WARMUP_STEPS + config.layout.reschedule_after),
                topology)
        trainer = assemble_prepared(run, topology, board=board,
                                    recorder=None if session is None else session.profiler)
        if session is not None:
            session.attach(trainer)
        if topology.rank == 0:
            _log_start(config, topology, trainer, auto)
        manager = CheckpointManager(checkpoint, log=_log) if checkpoint and checkpoint.active else None
        if manager is not None:
            manager.load(trainer)
        on_step = None if manager is None else manager.on_step
        switch = None
        if auto:
            check_memory_limit(trainer, config.layout.memory_limit)    # before step 0
            on_step = switch = ZbAutoSwitch(config, session, on_step, _log)
        evaluation = args.evaluation
        result = train(trainer, log=_log, progress=progress, on_step=on_step,
                       evaluation=evaluation, logging=args.logging)
        if manager is not None and not (evaluation is not None and evaluation.eval_only):
            manager.finish(trainer)
        metrics = result.to_dict()
        if manager is not None:
            metrics["checkpoint"] = manager.metrics()
        metrics.update(config=config.to_dict(), world_size=topology.world_size,
                       backend=topology.backend, device=str(topology.device),
                       versions=run_versions(topology.backend))
        if switch is not None:
            metrics["reschedule"] = switch.metrics(trainer, result.step_times,
                                                   rank=topology.rank)
        measured = session.finish(trainer) if session is not None and not auto else None
        if measured is not None:
            metrics["profile"] = {"steps": measured.steps, "makespans": measured.makespans(),
                                  "trace_out": profile.trace_out}
        if topology.rank == 0 and metrics_out:
            path = Path(metrics_out)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(metrics, indent=1))
            tmp.replace(path)
        if topology.world_size > 1:
            dist.barrier()      # no rank tears its groups down while a peer still uses them
        return RunOutcome(metrics, measured)
    finally:
        destroy_topology(topology)


def _log_start(config: TrainConfig, topology: Any, trainer: Any, auto: bool) -> None:
    """Rank 0's first lines: the run's layout and the versions it runs on."""
    plan, par = config.plan, config.plan.parallelism
    layout = (f"tp={par.tp}{' (sequence parallel)' if par.sequence_parallel else ''} "
              if par.tp > 1 else "")
    if par.cp > 1:
        layout += f"cp={par.cp} "
    if par.ep > 1:
        layout += f"ep={par.ep} "
    if par.zero:
        layout += f"zero={par.zero} " + (
            "(gradients reduced per microbatch) "
            if par.zero >= 2 and par.grad_reduce == "per_microbatch" else "")
    hf_model = config.inputs.hf_model
    _log(f"pipeexec: {plan.schedule_name} {layout}pp={par.pp} vpp={par.vpp} dp={par.dp} "
         f"m={plan.microbatches} b={par.micro_batch_size} precision={par.precision} "
         f"layers={plan.model.layers}+2 hidden={plan.model.hidden}"
         + (f" hf-model={hf_model}" if hf_model else
            f" hf-family={plan.model.family}" if plan.model.family else "")
         + f" on {topology.backend}/"
         f"{topology.device.type}; stage bounds {list(trainer.bounds)}")
    if plan.schedule_name == "zb-auto" and not auto:
        _log("pipeexec: zb-auto without --memory-limit searches its order from equal "
             "costs (F = I = W) with no limit; give --memory-limit to profile this run "
             "and search from its own costs")
    v = run_versions(topology.backend)
    _log(f"pipeexec: torch {v['torch']}" + (f", NCCL {v['nccl']}" if v["nccl"] else "")
         + ("" if v["torch_supported"] or topology.backend != "nccl" else
            " (outside the torch range the NCCL path supports: pipeexec/versions.py)"))
