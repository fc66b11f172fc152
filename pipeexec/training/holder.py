"""Who holds a rank's gradients, fp32 masters and AdamW state: one interface, two holders.

Megatron-Core's shape: its ``DistributedDataParallel`` owns the gradient buffers and their
buckets, and ``MegatronOptimizer`` / ``DistributedOptimizer`` share one interface (zero_grad,
step, the grad norm, a state dict) so the training loop never asks which one it has. Here:

* `ReplicatedOptimizer`: every data-parallel replica holds everything whole
  (`ddp.GradBuffer`'s one fp32 buffer, `precision.MasterWeights`, AdamW over the masters);
  gradients are averaged by one bucketed all-reduce after the step's backward.
* `zero.ShardedOptimizer` (and `zero.ExpertShardedOptimizer` under expert parallelism):
  ZeRO 1, 2 or 3 over the data-parallel group.

`gradient_holder` picks one from the config and topology. The `Trainer`
(`pipeexec.training.train`) talks to `GradientHolder` only.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from pipesim.schedule.sharding import Sharding

from .ddp import GradBuffer
from .optim import adamw_state_for, build_adamw, set_lr
from .precision import MasterWeights
from .zero import ExpertShardedOptimizer, ShardedOptimizer


class GradientHolder(Protocol):
    """One rank's gradients, masters and optimizer state, whatever their sharding.

    Life: construction (the parameters may move into the holder's buffers); ``grad_view`` of
    every parameter for the tied-parameter rule; ``start(tied)`` once the tied instances are
    equal. Per step: ``zero``; the runtime's backward actions (``accumulate``, or autograd into
    the bound ``.grad`` when ``grads_in_place``) and the program's sharding actions;
    ``reduce_gradients``; ``local_grad_sq`` into the caller's all-reduce; ``step`` unless the
    step is skipped. State by global parameter name, whole tensors: ``full_masters``,
    ``full_optimizer_state``, ``load``."""

    grads_in_place: bool
    # ZeRO-2/3: the Sharding the runtime's schedule is lowered with; its UNSHARD / RESHARD /
    # REDUCE_GRAD actions call `unshard` / `reshard` / `reduce_grad` (None: none inserted)
    sharding: Sharding | None
    owns_grads: bool

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...
    def grad_view(self, param: torch.Tensor) -> torch.Tensor | None: ...
    def start(self, tied=None) -> None: ...
    def unshard(self, stage: int) -> None: ...
    def reshard(self, stage: int) -> None: ...
    def reduce_grad(self, stage: int) -> None: ...
    def zero(self) -> None: ...
    def accumulate(self, stage: int, grads: Sequence[torch.Tensor | None]) -> None: ...
    def reduce_gradients(self) -> None: ...
    def grad_pieces(self, param: torch.Tensor) -> list[torch.Tensor]: ...
    def local_grad_sq(self, minus: torch.Tensor | None = None) -> torch.Tensor: ...
    def poison(self) -> None: ...
    def step(self, grad_scale: float, lr: float) -> None: ...
    def full_masters(self) -> dict[str, torch.Tensor]: ...
    def full_optimizer_state(self) -> dict[str, dict[str, Any]]: ...
    def load(self, model: Mapping[str, torch.Tensor],
             optimizer: Mapping[str, Mapping[str, Any]] | None = None) -> None: ...
    def held_tensors(self) -> Iterator[torch.Tensor]: ...
    def gather_all(self) -> None: ...
    def release_all(self) -> None: ...


class ReplicatedOptimizer:
    """Gradients, fp32 masters and AdamW whole on every replica (no ZeRO, or one replica).

    The dense gradients are averaged over ``group`` (``size`` ranks: dp x cp), the experts'
    (``is_expert``) summed over ``expert_group`` (``expert_size`` ranks) and divided by
    ``size`` as the dense ones (`ddp.GradBuffer`)."""

    sharding = None                 # nothing sharded: no sharding actions
    owns_grads = False

    def __init__(self, stages: Mapping[int, nn.Module], *, names: Sequence[str],
                 dtype: torch.dtype, device: torch.device,
                 is_expert: Callable[[torch.Tensor], bool], group: Any, size: int,
                 expert_group: Any, expert_size: int, lr: float, weight_decay: float,
                 betas: tuple[float, float], eps: float, timeout: float | None = None) -> None:
        """``names``: the global names of the stages' parameters, stages in ascending order."""
        self.stages, self.names, self.dtype = stages, list(names), dtype
        self.group, self.size = group, size
        self.expert_group, self.expert_size = expert_group, expert_size
        self.timeout = timeout
        self._hyper = dict(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
        self.buffer = GradBuffer({s: list(st.parameters()) for s, st in stages.items()},
                                 device, is_expert=is_expert)
        self._views = {id(p): v for s, st in stages.items()
                       for p, v in zip(st.parameters(), self.buffer.views[s])}
        # fp32: autograd adds into the buffer bound as the masters' (the parameters') .grad
        self.grads_in_place = dtype == torch.float32
        self.tied = None
        self.masters: MasterWeights | None = None
        self._optimizer: torch.optim.Optimizer | None = None

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optimizer

    def grad_view(self, param: torch.Tensor) -> torch.Tensor:
        return self._views[id(param)]

    def start(self, tied=None) -> None:
        """The fp32 masters (the parameters themselves in fp32; else copies, the parameters
        cast to the compute dtype), their ``.grad`` bound to the buffer, and AdamW."""
        self.tied = tied
        params = [p for s in sorted(self.stages) for p in self.stages[s].parameters()]
        self.masters = MasterWeights(params, self.dtype)
        flat_views = [v for s in self.stages for v in self.buffer.views[s]]
        for master, view in zip(self.masters.masters, flat_views):
            master.grad = view
        self._optimizer = build_adamw(list(zip(self.names, self.masters.masters)),
                                      **self._hyper)

    def unshard(self, stage: int) -> None:
        """The weights are always whole."""

    def reshard(self, stage: int) -> None:
        """The weights are always whole."""

    def reduce_grad(self, stage: int) -> None:
        """Reduced after the step's backward (`reduce_gradients`)."""

    def zero(self) -> None:
        self.buffer.zero()

    def accumulate(self, stage: int, grads: Sequence[torch.Tensor | None]) -> None:
        self.buffer.accumulate(stage, grads)

    def reduce_gradients(self) -> None:
        """Averaged over dp x cp (with cp each rank saw other tokens of the same sequences);
        experts summed over the ranks holding the same ones, / dp x cp as the dense; then the
        tied instances summed."""
        self.buffer.all_reduce(self.group, self.size, self.timeout)
        self.buffer.all_reduce_experts(self.expert_group, self.expert_size, self.size,
                                       self.timeout)
        if self.tied:
            self.tied.reduce()

    def grad_pieces(self, param: torch.Tensor) -> list[torch.Tensor]:
        return [self._views[id(param)]]

    def local_grad_sq(self, minus: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's share of the squared global norm (summed over all ranks): every dp x cp
        replica holds all of it, a tied parameter counting once; an expert's gradient is held
        by the dp x cp / ep ranks holding that expert. ``minus``: the squared norm of
        gradients this rank holds that count on another rank (tensor parallelism's
        replicated parameters)."""
        buf = self.buffer.data
        local_sq = torch.dot(buf, buf) if buf.numel() else torch.zeros((), device=buf.device)
        duplicate_sq = self.tied.duplicate_sq() if self.tied else None
        if duplicate_sq is not None:
            local_sq = local_sq - duplicate_sq
        if minus is not None:
            local_sq = local_sq - minus
        experts = self.buffer.experts
        share = local_sq / self.size
        if experts.numel():
            share = share + torch.dot(experts, experts) * (1 / self.expert_size - 1 / self.size)
        return share

    def poison(self) -> None:
        """Fault injection: an inf in this rank's gradient (the fp16 skip path)."""
        self.buffer.data[0] = float("inf")

    @torch.no_grad()
    def step(self, grad_scale: float, lr: float) -> None:
        self.buffer.data.mul_(grad_scale)
        set_lr(self._optimizer, lr)
        self._optimizer.step()
        self.masters.copy_to_model()

    def full_masters(self) -> dict[str, torch.Tensor]:
        return dict(zip(self.names, self.masters.masters))

    def full_optimizer_state(self) -> dict[str, dict[str, Any]]:
        out = {}
        for name, p in zip(self.names, self.masters.masters):
            st = self._optimizer.state.get(p)
            if st:
                out[name] = st
        return out

    @torch.no_grad()
    def load(self, model: Mapping[str, torch.Tensor],
             optimizer: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        for name, p in zip(self.names, self.masters.masters):
            p.copy_(model[name])
        self.masters.copy_to_model()
        if optimizer is not None:
            for name, p in zip(self.names, self.masters.masters):
                st = optimizer.get(name)
                if st is not None:
                    self._optimizer.state[p] = adamw_state_for(self._optimizer, p, st)

    def held_tensors(self) -> Iterator[torch.Tensor]:
        """The gradient buffer, the fp32 master copies (none in fp32) and AdamW's moments."""
        yield self.buffer.data
        if self.masters.copies:
            yield from self.masters.masters
        for st in self._optimizer.state.values():
            yield from (v for v in st.values() if torch.is_tensor(v))

    def gather_all(self) -> None:
        """The weights are always whole."""

    def release_all(self) -> None:
        """The weights are always whole."""


def gradient_holder(config, topology, stages: Mapping[int, nn.Module], *, names: Sequence[str],
                    dtype: torch.dtype, is_expert: Callable[[torch.Tensor], bool]
                    ) -> GradientHolder:
    """The holder a run's config and topology ask for: ZeRO 1-3 with more than one
    data-parallel replica (dense parameters sharded over dp x cp; with ep > 1 experts over
    their expert-data-parallel group), else the replicated one (ZeRO with one replica is a
    no-op, as Megatron's)."""
    opt, par = config.optimizer, config.plan.parallelism
    hyper = dict(lr=opt.lr, weight_decay=opt.weight_decay, betas=(opt.beta1, opt.beta2),
                 eps=opt.eps, timeout=config.runtime.collective_timeout)
    dev = topology.device
    if par.zero and topology.ep > 1:
        return ExpertShardedOptimizer(
            stages, is_expert=is_expert, level=par.zero, dtype=dtype,
            dense_group=topology.dp_cp_group, dense_shards=topology.dp_cp,
            dense_rank=topology.dp_cp_rank, expert_group=topology.edp_group,
            expert_shards=topology.edp, expert_rank=topology.edp_rank, device=dev,
            grad_reduce=par.grad_reduce, **hyper)
    if par.zero and topology.dp_cp > 1:
        return ShardedOptimizer(stages, level=par.zero, dtype=dtype,
                                group=topology.dp_cp_group, shards=topology.dp_cp,
                                rank=topology.dp_cp_rank, device=dev,
                                grad_reduce=par.grad_reduce, **hyper)
    return ReplicatedOptimizer(stages, names=names, dtype=dtype, device=dev,
                               is_expert=is_expert, group=topology.dp_cp_group,
                               size=topology.dp_cp, expert_group=topology.edp_group,
                               expert_size=topology.edp, **hyper)
