"""Expert parallelism: a MoE layer's experts spread over the ``ep`` ranks of an expert-parallel
group, each token sent to the rank that owns each expert it selected and its outputs sent
back (Megatron-LM's all-to-all token dispatcher, dropless).

* **Ownership.** Rank ``r`` of ``ep`` holds experts ``r E/ep ... (r+1) E/ep - 1``
  (`local_experts`); the router is replicated and runs on the rank's own tokens.
* **Dispatch** (`dispatch_tokens`): each (token, selected expert) pair is one row, ordered by
  expert (a stable sort, so by token within an expert); the per-expert counts are exchanged
  first (one small all-to-all), then the rows go to their owners with ``all_to_all_single``
  and variable splits, nothing dropped or padded (as Hugging Face's Mixtral, which computes
  every selected pair).
* **Local experts** (`experts_forward`): the rows a rank receives, grouped by its local
  expert, go through Hugging Face's expert arithmetic (``act(gate) * up``, then ``down``).
* **Combine**: the outputs return by the reverse all-to-all; the sender multiplies each by its
  routing weight and ``index_add``s it into the token's output, as HF does. The all-to-alls are
  autograd functions whose backward is the reverse all-to-all (same splits swapped), so the
  router's gradient stays local and an expert's gradient sums every rank's tokens routed to it.

Under tensor parallelism the experts are also tp-cut and the group is ranks of one tp rank: each
tp rank dispatches the same tokens (the router reads the same input on every tp rank) and the
block's partial sums leave through tp's reduction, as without ep. The all-to-alls run inside
the layer's F and B on the ep group's own communicator (`pipeexec.topology`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .group import GroupView
from torch.nn import functional as F


@dataclass(frozen=True)
class ExpertParallel(GroupView):
    """This rank's expert-parallel group: passed to every MoE layer that needs it."""


NONE = ExpertParallel(None)


def local_experts(num_experts: int, ep: ExpertParallel) -> range:
    """The global indices of the experts rank ``ep.rank`` holds."""
    if num_experts % ep.size:
        raise ValueError(f"expert parallelism: {num_experts} experts do not divide over ep = "
                         f"{ep.size} ranks")
    n = num_experts // ep.size
    return range(ep.rank * n, (ep.rank + 1) * n)


def _all_to_all(x: torch.Tensor, out_rows: list[int], in_rows: list[int],
                ep: ExpertParallel) -> torch.Tensor:
    """Rows ``in_rows[r]`` of ``x`` (in rank order) to rank r; ``out_rows[r]`` rows from it."""
    x = x.contiguous()
    out = x.new_empty((sum(out_rows),) + tuple(x.shape[1:]))
    work = dist.all_to_all_single(out, x, out_rows, in_rows, group=ep.group, async_op=True)
    ep.wait(work)
    return out


class _AllToAll(torch.autograd.Function):
    """The rows to their ranks; backward: the gradients back by the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_rows: list[int], in_rows: list[int],
                ep: ExpertParallel) -> torch.Tensor:
        ctx.rows, ctx.ep = (out_rows, in_rows), ep
        return _all_to_all(x, out_rows, in_rows, ep)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_rows, in_rows = ctx.rows
        return _all_to_all(grad, in_rows, out_rows, ctx.ep), None, None, None


def exchange_counts(counts: torch.Tensor, ep: ExpertParallel) -> torch.Tensor:
    """``counts[e]``: the rows this rank sends to global expert ``e`` (E of them) -> the rows
    it receives, shape (ep, E/ep): ``[r, j]`` from rank r for its local expert j."""
    n = counts.numel() // ep.size
    got = _all_to_all(counts.to(torch.int64), [n] * ep.size, [n] * ep.size, ep)
    return got.view(ep.size, n)


@dataclass(frozen=True)
class Routing:
    """One dispatch's bookkeeping, for the combine: where each sent row came from."""

    token: torch.Tensor         # (rows,) the token of each sent row, in send order
    weight: torch.Tensor        # (rows,) its routing weight
    sent: list[int]             # rows sent to each rank
    received: list[int]         # rows received from each rank
    per_expert: torch.Tensor    # (ep, E/ep) rows received from rank r for local expert j


def dispatch_tokens(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                    num_experts: int, ep: ExpertParallel) -> tuple[torch.Tensor, Routing]:
    """``hidden`` (tokens, h), the router's (tokens, k) choices and weights -> the rows this
    rank's experts compute (grouped by source rank, then local expert) and the routing."""
    k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // k
    weight = top_k_weights.reshape(-1)[order]
    counts = torch.bincount(flat, minlength=num_experts)
    per_expert = exchange_counts(counts, ep)
    sent = counts.view(ep.size, -1).sum(1).tolist()
    received = per_expert.sum(1).tolist()
    rows = _AllToAll.apply(hidden[token], received, sent, ep)
    return rows, Routing(token, weight, sent, received, per_expert)


def combine_tokens(rows: torch.Tensor, routing: Routing, like: torch.Tensor,
                   ep: ExpertParallel) -> torch.Tensor:
    """The experts' output rows back to their senders, weighted and summed per token (HF's
    ``index_add_`` of ``output * weight``) into a tensor shaped as ``like``."""
    back = _AllToAll.apply(rows, routing.sent, routing.received, ep)
    out = torch.zeros_like(like)
    return out.index_add(0, routing.token, (back * routing.weight[:, None]).to(like.dtype))


def experts_forward(rows: torch.Tensor, per_expert: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]
                    ) -> torch.Tensor:
    """Each received row through its local expert (HF's arithmetic: ``act(gate) * up``, then
    ``down``), in the received order. ``per_expert[r, j]``: rows from rank r for expert j."""
    ranks, n = per_expert.shape
    counts = per_expert.reshape(-1).tolist()
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    # the received rows regrouped by local expert (from every rank), and back after
    perm, sizes = [], []
    for j in range(n):
        idx = [torch.arange(starts[r * n + j], starts[r * n + j + 1], device=rows.device)
               for r in range(ranks) if counts[r * n + j]]
        sizes.append(sum(len(i) for i in idx))
        perm += idx
    if not perm:
        return rows.new_zeros((0, down.shape[1]))
    perm_t = torch.cat(perm)
    grouped = rows[perm_t].split(sizes)
    outs = []
    for j, x in enumerate(grouped):
        if not sizes[j]:
            continue                    # an expert no token chose (HF skips it too)
        gate, up = F.linear(x, gate_up[j]).chunk(2, dim=-1)
        outs.append(F.linear(act(gate) * up, down[j]))
    return torch.cat(outs)[torch.argsort(perm_t)]


def expert_parallel_moe(hidden: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                        act: Callable[[torch.Tensor], torch.Tensor], num_experts: int,
                        ep: ExpertParallel) -> torch.Tensor:
    """The experts' output for this rank's tokens: dispatch, local experts, combine."""
    rows, routing = dispatch_tokens(hidden, top_k_index, top_k_weights, num_experts, ep)
    out = experts_forward(rows, routing.per_expert, gate_up, down, act)
    return combine_tokens(out, routing, hidden, ep)
