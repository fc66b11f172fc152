"""`RankParts`: what one rank runs, built once by `pipeexec.run.assemble` and handed to a
`Trainer` as a value, so that the Trainer holds the step and its state and nothing of how a
rank is put together (training, paired runs and profiling all assemble a rank the same way)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipesim import Schedule

from ..config import TrainConfig
from ..data import BatchSource
from ..launching.board import ActionBoard
from ..model import LayerStack
from ..parallel.context import ContextParallel
from ..parallel.experts import ExpertParallel
from ..parallel.regions import TensorParallel
from ..pipeline.p2p import P2P
from ..pipeline.runtime import ActionObserver
from ..topology import Topology


@dataclass
class RankParts:
    """One rank of a run, before its training state: the validated ``config``, its
    ``topology``, the tensor / context / expert-parallel groups (``tp``, ``cp``, ``ep``), the
    layer stack ``spec`` cut at ``bounds``, the ``schedule`` (``custom_schedule``: given as data,
    not built from the config's name) and this rank's ``stages``, the compute ``dtype``, the
    pipeline's ``p2p`` (None at pp 1), the batches (``data``), the launcher's ``board`` and the
    runtime's ``observers`` (``board_observer`` among them; ``overflow``: the steps fault
    injection poisons a gradient at)."""

    config: TrainConfig
    topology: Topology
    tp: TensorParallel
    cp: ContextParallel
    ep: ExpertParallel
    spec: LayerStack
    schedule: Schedule
    custom_schedule: bool
    bounds: tuple[int, ...]
    stages: dict[int, torch.nn.Module]
    dtype: torch.dtype
    p2p: P2P | None
    data: BatchSource
    board: ActionBoard | None = None
    board_observer: ActionObserver | None = None
    observers: list[ActionObserver] = field(default_factory=list)
    overflow: set[int] = field(default_factory=set)
