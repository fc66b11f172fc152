"""What tensor parallelism adds to a step's gradients, after the backward:

* parameters replicated on every tp rank but fed one sequence chunk each (norms and
  row-parallel biases under sequence parallelism) hold partial gradients: they are summed over
  the tp group (Megatron's ``_allreduce_layernorm_grads``), one coalesced all-reduce;
* in the global norm a replicated parameter counts once (on tp rank 0), a cut one on every
  rank (Megatron's ``param_is_not_tensor_parallel_duplicate``).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .regions import TensorParallel, all_reduce
from .sharding import is_sequence_parallel, shard_spec


class TensorParallelGrads:
    def __init__(self, params: Sequence[torch.nn.Parameter], grads: Sequence[torch.Tensor],
                 tp: TensorParallel) -> None:
        """``grads``: each parameter's fp32 gradient (a view of the caller's buffer)."""
        self.tp = tp
        self._sp = [g for p, g in zip(params, grads) if is_sequence_parallel(p)]
        self._replicated = [g for p, g in zip(params, grads) if shard_spec(p) is None]

    def reduce_sequence_parallel(self) -> None:
        """Sum the partial gradients of sequence-parallel parameters over tp (in place)."""
        if not self.tp.active or not self._sp:
            return
        flat = all_reduce(torch.cat([g.reshape(-1) for g in self._sp]), self.tp)
        offset = 0
        for g in self._sp:
            n = g.numel()
            g.copy_(flat[offset: offset + n].view_as(g))
            offset += n

    def duplicate_sq(self) -> torch.Tensor | None:
        """The squared norm this rank must not add to the global one: its replicated
        parameters' unless it is tp rank 0 (None when nothing is to be taken off)."""
        if not self.tp.active or self.tp.rank == 0 or not self._replicated:
            return None
        return sum(torch.dot(g.reshape(-1), g.reshape(-1)) for g in self._replicated)
