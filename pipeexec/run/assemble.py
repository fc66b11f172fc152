"""`assemble`: one rank built once, the same way for training, paired runs and profiling.

From a validated run (`prepare`) and this process's `Topology` it builds the rank's tensor,
context and expert-parallel groups, its layer stack cut into this rank's stages, the pipeline's
point-to-point transfers, the batches and the runtime's observers (the launcher's board, fault
injection, a profiler), and hands them as one `RankParts` value to the `Trainer`, which builds
the training state (gradient holder, masters, optimizer) and the runtime over them.
"""
from __future__ import annotations

import torch

from pipesim import Schedule

from ..config import TrainConfig
from ..data import BatchSource, batch_source
from ..launching.board import ActionBoard, BoardObserver
from ..malloc import keep_freed_memory
from ..model import LayerStack
from ..models import checked_layer_stack
from ..parallel.context import ContextParallel, ContextParallelBatches
from ..parallel.experts import ExpertParallel
from ..parallel.regions import TensorParallel
from ..partition import stage_bounds
from ..pipeline.faults import FaultInjector, parse_faults
from ..pipeline.p2p import P2P, check_channels_exist, check_p2p_order
from ..pipeline.runtime import ActionObserver
from ..pipeline.stage import build_stage
from ..topology import Topology
from ..training.precision import compute_dtype
from ..training.rank import RankParts
from ..training.train import Trainer
from .prepare import PreparedRun, prepare


def assemble(config: TrainConfig, topology: Topology, spec: LayerStack | None = None, *,
             recorder: ActionObserver | None = None, board: ActionBoard | None = None,
             data: BatchSource | None = None, schedule: Schedule | None = None) -> Trainer:
    """The `Trainer` of this rank of ``config``, validated here (`prepare`). ``spec``: a
    layer stack of the caller's instead of the plan's model; ``schedule``: run this Schedule
    (any pipesim Schedule, e.g. hand-made) instead of the one ``config.schedule`` names, its
    pp, vpp and microbatches the config's; ``data``: the batches (default: the config's).
    The runtime's observers: the ``board``'s, fault injection's (``config.inject``), then
    ``recorder`` (shorthand for `Trainer.add_observer`)."""
    run = prepare(config, world_size=topology.world_size, schedule=schedule,
                  num_layers=None if spec is None else spec.num_layers)
    par = config.plan.parallelism
    if (par.tp, par.cp, par.pp, par.dp, par.ep) != (
            topology.tp, topology.cp, topology.pp, topology.dp, topology.ep):
        raise ValueError(f"config tp={par.tp} cp={par.cp} pp={par.pp} dp={par.dp} "
                         f"ep={par.ep} but topology tp={topology.tp} cp={topology.cp} "
                         f"pp={topology.pp} dp={topology.dp} ep={topology.ep}")
    return assemble_prepared(run, topology, spec, recorder=recorder, board=board, data=data)


def assemble_prepared(run: PreparedRun, topology: Topology, spec: LayerStack | None = None, *,
                      recorder: ActionObserver | None = None, board: ActionBoard | None = None,
                      data: BatchSource | None = None) -> Trainer:
    """`assemble` of a run validated before launch, on a topology built from its config:
    the config and the schedule taken as they are."""
    config = run.config
    tp, cp, ep = _parallel_groups(config, topology)
    spec = spec or checked_layer_stack(config, tp, cp, ep)
    schedule = run.schedule
    bounds = stage_bounds(spec, config)
    dev = topology.device
    if dev.type == "cpu" and config.runtime.cpu_keep_freed_memory:
        keep_freed_memory()         # no fresh pages, hence no page faults, every step
    # A stage builds the model part it computes: a copy of a part (dualpipe's second
    # direction) has the same layers and global names, so the Trainer ties their parameters.
    part = schedule.stage_part
    stages = {s: build_stage(spec, part(s), bounds, seed=config.runtime.seed, device=dev,
                             dtype=torch.float32)
              for s in schedule.rank_stages(topology.pp_rank)}
    kinds, par = spec.kinds(), config.plan.parallelism
    for s, stage in stages.items():
        stage.set_recompute(par.recompute, kinds[bounds[part(s)]:bounds[part(s) + 1]],
                            par.recompute_layers)
    faults, overflow = parse_faults(config.runtime.inject, topology.rank)
    board_observer = None if board is None else BoardObserver(board, topology.rank)
    observers = [o for o in (board_observer, FaultInjector(faults) if faults else None, recorder)
                 if o is not None]
    batches = data or batch_source(config)
    if cp.active:      # every cp rank of a replica: the same microbatches, its chunks
        batches = ContextParallelBatches(batches, cp)
    return Trainer(RankParts(
        config=config, topology=topology, tp=tp, cp=cp, ep=ep, spec=spec, schedule=schedule,
        custom_schedule=run.custom_schedule, bounds=bounds, stages=stages,
        dtype=compute_dtype(par.precision), p2p=_p2p(config, topology, schedule),
        data=batches, board=board, board_observer=board_observer, observers=observers,
        overflow=overflow))


def _parallel_groups(config: TrainConfig, topology: Topology
                     ) -> tuple[TensorParallel, ContextParallel, ExpertParallel]:
    """This rank's tensor-parallel (with sequence parallelism), context-parallel (each
    sequence cut over the cp group) and expert-parallel (a MoE layer's experts over the ep
    group) groups."""
    timeout = config.runtime.collective_timeout
    sequence_parallel = bool(config.plan.parallelism.sequence_parallel) and topology.tp > 1
    return (TensorParallel(topology.tp_group, topology.tp, topology.tp_rank, timeout=timeout,
                           sequence_parallel=sequence_parallel),
            ContextParallel(topology.cp_group, topology.cp, topology.cp_rank, timeout=timeout),
            ExpertParallel(topology.ep_group, topology.ep, topology.ep_rank, timeout=timeout))


def _p2p(config: TrainConfig, topology: Topology, schedule: Schedule) -> P2P | None:
    """The pipeline's transfers (None at pp 1), the schedule's channels and (on NCCL, or gloo
    matching as NCCL does) its posting order checked before the first step."""
    if config.plan.parallelism.pp == 1:
        return None
    runtime = config.runtime
    check_channels_exist(schedule, topology.pp_rank, topology.p2p_groups)
    if topology.backend == "nccl" or runtime.nccl_matching:
        check_p2p_order(schedule, collectives=topology.tp > 1 or topology.cp > 1
                        or topology.ep > 1 or config.plan.parallelism.zero >= 2)
    return P2P(rank=topology.rank, pp_rank=topology.pp_rank, groups=topology.p2p_groups,
               peers=topology.pp_ranks, num_stages=schedule.num_stages,
               num_microbatches=config.plan.microbatches, device=topology.device,
               timeout=runtime.p2p_timeout, nccl_matching=runtime.nccl_matching)
