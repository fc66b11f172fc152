"""The four crossings between replicated and tensor-parallel activations, as autograd
functions with an explicit group (Megatron-LM's ``mappings``: each collective's backward is
the conjugate collective).

Activations are ``(batch, sequence, hidden)``; sequence parallelism cuts dimension 1 into
``tp`` contiguous chunks (rank r holds chunk r).

* `copy_to` (into a column-parallel layer): forward identity, backward all-reduce;
* `reduce_from` (out of a row-parallel layer): forward all-reduce, backward identity;
* `gather_sequence` (into a column-parallel layer under sequence parallelism): forward
  all-gather along the sequence, backward reduce-scatter;
* `reduce_scatter_sequence` (out of a row-parallel layer under sequence parallelism): forward
  reduce-scatter along the sequence, backward all-gather;
* `scatter_sequence` (replicated to sequence-parallel, after the embedding): forward keep this
  rank's chunk, backward all-gather.

Why not DTensor's ``ColwiseParallel`` / ``RowwiseParallel``: this runtime holds plain tensors
(p2p buffers, the flat fp32 gradient buffer each parameter's ``.grad`` is a view of, Zero
Bubble's split backward over autograd's nodes); DTensor parameters would carry DTensor
gradients that cannot be views of that buffer. The collectives are the same ones.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .group import GroupView


@dataclass(frozen=True)
class TensorParallel(GroupView):
    """This rank's tensor-parallel group: passed to every layer that needs it."""

    sequence_parallel: bool = False


NONE = TensorParallel(None)


def all_reduce(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    x = x.contiguous()
    tp.wait(dist.all_reduce(x, group=tp.group, async_op=True))
    return x


def all_gather_sequence(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """(b, s/tp, ...) on each rank -> (b, s, ...), rank r's chunk at position r."""
    x = x.contiguous()
    out = torch.empty((tp.size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    tp.wait(dist.all_gather_single(out, x, group=tp.group, async_op=True))
    out = out.view(tp.size, *x.shape)
    return out.movedim(0, 1).reshape(x.shape[0], tp.size * x.shape[1], *x.shape[2:])


def reduce_scatter_sequence(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """(b, s, ...) partial sums on each rank -> this rank's chunk (b, s/tp, ...) of the sum."""
    b, s = x.shape[0], x.shape[1]
    if s % tp.size:
        raise ValueError(f"sequence parallelism: sequence length {s} is not a multiple of "
                         f"tp = {tp.size}")
    chunks = x.reshape(b, tp.size, s // tp.size, *x.shape[2:]).movedim(1, 0).contiguous()
    out = torch.empty(chunks.shape[1:], dtype=x.dtype, device=x.device)
    chunks = chunks.view(tp.size * b, *chunks.shape[2:])
    tp.wait(dist.reduce_scatter_single(out, chunks, group=tp.group, async_op=True))
    return out


def sequence_chunk(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    s = x.shape[1]
    if s % tp.size:
        raise ValueError(f"sequence parallelism: sequence length {s} is not a multiple of "
                         f"tp = {tp.size}")
    return x.narrow(1, tp.rank * (s // tp.size), s // tp.size).contiguous()


def _crossing(name: str, forward, backward):
    """``x -> forward(x, tp)`` with ``backward(g, tp)`` as its gradient (an autograd function
    named ``name``, e.g. ``CopyToBackward`` in a profile); the identity when tp is 1."""

    def fwd(ctx, x, tp):
        ctx.tp = tp
        return forward(x, tp)

    def bwd(ctx, g):
        return backward(g, ctx.tp), None

    fn = type(name, (torch.autograd.Function,),
              {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})

    def apply(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
        return fn.apply(x, tp) if tp.active else x
    return apply


copy_to = _crossing("CopyTo", lambda x, tp: x.view_as(x), lambda g, tp: all_reduce(g.clone(), tp))
reduce_from = _crossing("ReduceFrom", lambda x, tp: all_reduce(x.clone(), tp), lambda g, tp: g)
gather_sequence = _crossing("GatherSequence", all_gather_sequence, reduce_scatter_sequence)
reduce_scatter_to_sequence = _crossing("ReduceScatterSequence", reduce_scatter_sequence,
                                       all_gather_sequence)
scatter_sequence = _crossing("ScatterSequence", sequence_chunk, all_gather_sequence)


def into_column(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The input of a column-parallel layer: the whole sequence, gradient summed over tp."""
    return gather_sequence(x, tp) if tp.sequence_parallel else copy_to(x, tp)


def out_of_row(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The output of a row-parallel layer: summed over tp (this rank's chunk under sp)."""
    return reduce_scatter_to_sequence(x, tp) if tp.sequence_parallel else reduce_from(x, tp)
