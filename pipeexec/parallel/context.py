"""Context parallelism: each sequence cut over the ``cp`` ranks of a context-parallel group,
attention of the local queries against every key.

* **Load-balanced chunks** (Megatron's ``get_batch_on_this_cp_rank``, torch's
  ``context_parallel``): the sequence is cut into ``2 cp`` equal chunks and rank ``i`` holds
  chunks ``i`` and ``2 cp - 1 - i``, so under the causal mask every rank attends to about the
  same number of keys (`chunk_bounds`, `positions`, `split_sequence`, `merge_sequence`).
  Tokens, targets and every activation a rank holds are its two chunks, in that order; learned
  positions and rotary take `positions` (the tokens' global positions).
* **K/V by all-gather** (`context_parallel_attention`): K and V of the local tokens are
  all-gathered over the cp group (one collective for both, on the group's own communicator),
  put in global order, and the local queries attend to them with the causal mask at their
  global positions (and a sliding window's, when the layer has one). The backward
  reduce-scatters dK and dV to their owners.
* **Only the chunk is kept.** The attention keeps this rank's q, k and v for the backward,
  never the gathered K/V: the backward gathers them again and recomputes the attention's
  forward to take its gradient (as Transformer Engine's all-gather CP gathers K/V again in its
  backward, and as selective recomputation redoes the core attention), so the activations a
  rank holds are pipesim's footprint at ``s / cp`` (`pipesim.plan.footprint`), the attention's
  log-sum-exp left out.

Why an all-gather and not a ring: torch's ``context_parallel`` (its ring of SDPA with
log-sum-exp merging) does not run on CPU (its DTensor rules have no sharding strategy for the
CPU flash-attention operator), and a ring of our own needs the softmax's log-sum-exp per step,
which no public SDPA returns; the all-gather runs any attention
implementation (torch's SDPA, a Hugging Face family's eager or SDPA attention) unchanged, with a
mask. Its cost is the K/V of the whole sequence held transiently in each attention, and the
exchange not overlapped with compute (Llama 3 trained with the same all-gather CP, its K/V
being small under GQA).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .group import GroupView


@dataclass(frozen=True)
class ContextParallel(GroupView):
    """This rank's context-parallel group: passed to every layer that needs it."""


NONE = ContextParallel(None)


def chunk_bounds(seq_len: int, size: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The two ``[start, stop)`` ranges of the whole sequence rank ``rank`` of ``size`` holds:
    chunks ``rank`` and ``2 size - 1 - rank`` of ``2 size``."""
    if seq_len % (2 * size):
        raise ValueError(f"context parallelism: sequence length {seq_len} is not a multiple of "
                         f"2 * cp = {2 * size} (load-balanced causal chunks)")
    if not 0 <= rank < size:
        raise ValueError(f"context parallelism: rank {rank} outside 0..{size - 1}")
    c = seq_len // (2 * size)
    return (rank * c, (rank + 1) * c), ((2 * size - 1 - rank) * c, (2 * size - rank) * c)


def positions(seq_len: int, size: int, rank: int, device: Any = None) -> torch.Tensor:
    """The global positions (int64) of the ``seq_len / size`` tokens rank ``rank`` holds, in
    the order it holds them."""
    (a, b), (c, d) = chunk_bounds(seq_len, size, rank)
    return torch.cat([torch.arange(a, b, device=device), torch.arange(c, d, device=device)])


def local_positions(local_len: int, cp: ContextParallel, device: Any = None) -> torch.Tensor:
    """`positions` of this rank from the length it holds (``seq_len / cp``)."""
    return positions(local_len * cp.size, cp.size, cp.rank, device)


def split_sequence(x: torch.Tensor, size: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s two chunks of ``x`` along ``dim``, in storage of their own."""
    (a, b), (c, d) = chunk_bounds(x.shape[dim], size, rank)
    return torch.cat([x.narrow(dim, a, b - a), x.narrow(dim, c, d - c)], dim=dim)


def merge_sequence(parts: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's `split_sequence` (in rank order): its inverse."""
    half = parts[0].shape[dim] // 2
    first = [p.narrow(dim, 0, half) for p in parts]
    second = [p.narrow(dim, half, half) for p in reversed(parts)]
    return torch.cat(first + second, dim=dim)


class ContextParallelBatches:
    """A `pipeexec.data.BatchSource` (or validation data) seen by one cp rank: every cp rank of
    a data-parallel replica is given the same microbatches and keeps its two chunks of each
    (tokens and targets alike). ``microbatches`` is all a run reads of its data; the whole
    source is ``source``."""

    def __init__(self, source: Any, cp: ContextParallel) -> None:
        self.source, self.cp = source, cp

    def microbatches(self, step: int, dp_rank: int, dp: int, m: int
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cp = self.cp
        return [tuple(split_sequence(t, cp.size, cp.rank) for t in mb)
                for mb in self.source.microbatches(step, dp_rank, dp, m)]


def _global_order(size: int) -> list[tuple[int, int]]:
    """For each of the ``2 size`` chunks in sequence order: (rank holding it, its half there)."""
    return [(j, 0) if j < size else (2 * size - 1 - j, 1) for j in range(2 * size)]


def gather_kv(kv: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """``(..., L, d)`` on each rank (``L = s / cp``, its two chunks) -> ``(..., s, d)``, the
    whole sequence in global order."""
    kv = kv.contiguous()
    out = torch.empty((cp.size * kv.shape[0],) + tuple(kv.shape[1:]), dtype=kv.dtype,
                      device=kv.device)
    cp.wait(dist.all_gather_single(out, kv, group=cp.group, async_op=True))
    out = out.view(cp.size, *kv.shape)
    c = kv.shape[-2] // 2
    return torch.cat([out[r].narrow(-2, h * c, c) for r, h in _global_order(cp.size)],
                     dim=-2)


def reduce_scatter_kv(grad: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """The conjugate of `gather_kv`: ``(..., s, d)`` partial gradients on each rank -> this
    rank's ``(..., L, d)`` of their sum."""
    c = grad.shape[-2] // (2 * cp.size)
    pieces = torch.stack([torch.cat([grad.narrow(-2, r * c, c),
                                     grad.narrow(-2, (2 * cp.size - 1 - r) * c, c)], dim=-2)
                          for r in range(cp.size)])
    out = torch.empty(pieces.shape[1:], dtype=grad.dtype, device=grad.device)
    pieces = pieces.view(cp.size * pieces.shape[1], *pieces.shape[2:])
    cp.wait(dist.reduce_scatter_single(out, pieces, group=cp.group, async_op=True))
    return out


def causal_mask(local_len: int, cp: ContextParallel, device: Any,
                window: int | None = None) -> torch.Tensor:
    """``(L, s)`` bool, True where a local query (at its global position) may attend to a key
    of the whole sequence: the key at or before it (within ``window`` positions, Hugging
    Face's sliding window: ``q - k < window``)."""
    q = local_positions(local_len, cp, device).unsqueeze(1)
    k = torch.arange(local_len * cp.size, device=device).unsqueeze(0)
    allowed = k <= q
    if window is not None:
        allowed &= (q - k) < window
    return allowed


# attend(q, k, v, mask) -> output: any attention over the whole sequence's k, v with a bool mask
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp, attend, window):
        ctx.cp, ctx.attend, ctx.window = cp, attend, window
        ctx.save_for_backward(q, k, v)
        with torch.no_grad():
            kf, vf = gather_kv(torch.stack([k, v]), cp).unbind(0)
            mask = causal_mask(q.shape[-2], cp, q.device, window)
            return attend(q, kf, vf, mask)

    @staticmethod
    def backward(ctx, g):
        q, k, v = ctx.saved_tensors
        cp = ctx.cp
        with torch.no_grad():
            kv = gather_kv(torch.stack([k.detach(), v.detach()]), cp)
        with torch.enable_grad():
            qg = q.detach().requires_grad_(q.requires_grad)
            kf, vf = kv[0].detach().requires_grad_(), kv[1].detach().requires_grad_()
            out = ctx.attend(qg, kf, vf, causal_mask(q.shape[-2], cp, q.device, ctx.window))
            wrt = (qg, kf, vf) if q.requires_grad else (kf, vf)
            grads = torch.autograd.grad(out, wrt, g)
        dq = grads[0] if q.requires_grad else None
        dk, dv = reduce_scatter_kv(torch.stack(grads[-2:]), cp).unbind(0)
        return dq, dk, dv, None, None, None


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               cp: ContextParallel, attend: Attend, *,
                               window: int | None = None) -> torch.Tensor:
    """``attend`` of this rank's queries ``q (..., L, d)`` against the whole sequence's keys
    and values, gathered from every cp rank's ``k``, ``v (..., L, d)``, under the causal mask
    at the global positions (`causal_mask`). ``attend(q, k, v, mask)`` computes one attention
    (no dropout: its backward recomputes it). Differentiable in q, k and v."""
    return _ContextParallelAttention.apply(q, k, v, cp, attend, window)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """torch's scaled dot-product attention with a bool mask: the built-in GPT's `Attend`."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
