"""Tensor-parallel layers, each cut from the whole layer one process would build (so every tp
computes the same model), Megatron-LM's semantics:

* `ColumnParallelLinear`: output features cut over tp (``y_r = x W_r^T + b_r``); input entered
  through `regions.into_column` (gradient all-reduced; all-gathered sequence under sp);
* `RowParallelLinear`: input features cut over tp; the partial products summed by
  `regions.out_of_row` (all-reduce; reduce-scatter along the sequence under sp), then the
  replicated bias added;
* `vocab_parallel_embedding`: the rows of the vocabulary cut over tp, tokens outside a rank's
  range looked up as zeros, the partial embeddings summed;
* `vocab_parallel_cross_entropy`: the loss over logits whose vocabulary is cut over tp, from
  all-reduced max, sum of exponentials and target logit (no rank gathers the logits).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import regions
from .regions import TensorParallel
from .sharding import ShardSpec, mark, shard


def _cut(t: torch.Tensor, spec: ShardSpec, tp: TensorParallel) -> nn.Parameter:
    return mark(nn.Parameter(shard(t.detach(), spec, tp.rank, tp.size)), spec)


class ColumnParallelLinear(nn.Module):
    """``gather_output=False`` always: the output stays cut (the next layer is row-parallel,
    or the vocab-parallel loss reads it). ``groups``: the fused blocks of the weight's rows
    (3 for a fused q, k, v projection), each cut over tp."""

    def __init__(self, full: nn.Linear, tp: TensorParallel, *, groups: int = 1) -> None:
        super().__init__()
        self.tp = tp
        spec = ShardSpec(0, groups)
        self.weight = _cut(full.weight, spec, tp)
        self.bias = _cut(full.bias, spec, tp) if full.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(regions.into_column(x, self.tp), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, full: nn.Linear, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.weight = _cut(full.weight, ShardSpec(1), tp)
        self.bias = None
        if full.bias is not None:
            self.bias = mark(nn.Parameter(full.bias.detach().clone()),
                             sequence_parallel=tp.sequence_parallel and tp.active)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = regions.out_of_row(F.linear(x, self.weight), self.tp)
        return y if self.bias is None else y + self.bias


def vocab_range(vocab: int, tp: TensorParallel) -> tuple[int, int]:
    if vocab % tp.size:
        raise ValueError(f"a vocabulary of {vocab} rows does not cut into tp = {tp.size} equal "
                         "parts (pad it: --vocab-divisible-by)")
    per = vocab // tp.size
    return tp.rank * per, (tp.rank + 1) * per


def vocab_parallel_embedding(tokens: torch.Tensor, weight: torch.Tensor, vocab: int,
                             tp: TensorParallel) -> torch.Tensor:
    """The rows of ``tokens`` in this rank's ``weight`` (its vocabulary range), summed over
    tp: the full embedding on every rank (before any sequence scatter)."""
    if not tp.active:
        return F.embedding(tokens, weight)
    lo, hi = vocab_range(vocab, tp)
    outside = (tokens < lo) | (tokens >= hi)
    local = (tokens - lo).masked_fill(outside, 0)
    out = F.embedding(local, weight).masked_fill(outside.unsqueeze(-1), 0.0)
    return regions.reduce_from(out, tp)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, tp, vocab_start):
        # logits: (n, v/tp) fp32 on each rank; target: (n,) global ids
        logits_max = logits.max(dim=-1).values
        regions.wait(torch.distributed.all_reduce(logits_max, op=torch.distributed.ReduceOp.MAX,
                                                   group=tp.group, async_op=True), tp)
        shifted = logits - logits_max.unsqueeze(-1)
        v_local = logits.shape[-1]
        outside = (target < vocab_start) | (target >= vocab_start + v_local)
        local_t = (target - vocab_start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        both = torch.stack([picked, sum_exp])
        regions.wait(torch.distributed.all_reduce(both, group=tp.group, async_op=True), tp)
        picked, sum_exp = both[0], both[1]
        loss = sum_exp.log() - picked
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, outside)
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, local_t, outside = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_t] -= (~outside).to(grad.dtype)
        return grad * g.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab: int,
                                 tp: TensorParallel) -> torch.Tensor:
    """Mean next-token cross-entropy of logits cut over the vocabulary (fp32), equal on every
    tp rank; plain cross-entropy when tp is 1."""
    flat = logits.float().reshape(-1, logits.shape[-1])
    if not tp.active:
        return F.cross_entropy(flat, targets.reshape(-1))
    lo, _ = vocab_range(vocab, tp)
    return _VocabParallelCrossEntropy.apply(flat, targets.reshape(-1), tp, lo).mean()
