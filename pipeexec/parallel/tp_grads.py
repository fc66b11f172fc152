"""What tensor parallelism adds to a step's gradients, after their data-parallel reduction:

* parameters replicated on every tp rank but fed one sequence chunk each (norms and
  row-parallel biases under sequence parallelism) hold partial gradients: they are summed over
  the tp group (Megatron's ``_allreduce_layernorm_grads``), one coalesced all-reduce;
* in the global norm a replicated parameter counts once (on tp rank 0), a cut one on every
  rank (Megatron's ``param_is_not_tensor_parallel_duplicate``).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .regions import TensorParallel, all_reduce
from .sharding import is_sequence_parallel, shard_spec


GradsOf = Callable[[torch.nn.Parameter], Sequence[torch.Tensor]]


class TensorParallelGrads:
    def __init__(self, params: Sequence[torch.nn.Parameter], grads_of: GradsOf,
                 tp: TensorParallel) -> None:
        """``grads_of(param)``: the fp32 gradient tensors of ``param`` this rank holds once
        the data-parallel reduction is done (its view of the gradient buffer; under ZeRO its
        shard's pieces, possibly none). Every rank of a tp group holds the same layout, so the
        pieces line up across the group."""
        self.tp, self.grads_of = tp, grads_of
        self._sp = [p for p in params if is_sequence_parallel(p)]
        self._replicated = [p for p in params if shard_spec(p) is None]

    def reduce_sequence_parallel(self) -> None:
        """Sum the partial gradients of sequence-parallel parameters over tp (in place)."""
        if not self.tp.active:
            return
        grads = [g for p in self._sp for g in self.grads_of(p) if g.numel()]
        if not grads:
            return
        flat = all_reduce(torch.cat([g.reshape(-1) for g in grads]), self.tp)
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset: offset + n].view_as(g))
            offset += n

    def duplicate_sq(self) -> torch.Tensor | None:
        """The squared norm this rank must not add to the global one: its replicated
        parameters' unless it is tp rank 0 (None when nothing is to be taken off)."""
        if not self.tp.active or self.tp.rank == 0:
            return None
        grads = [g.reshape(-1) for p in self._replicated for g in self.grads_of(p)]
        return sum(torch.dot(g, g) for g in grads) if grads else None
