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
    (3 for a fused q, k, v projection), each cut over tp. ``entered``: the input is already
    in the column region (one `regions.into_column` for several projections of one input,
    as a Hugging Face attention's q, k and v, which it reshapes by its input's length)."""

    def __init__(self, full: nn.Linear, tp: TensorParallel, *, groups: int = 1,
                 entered: bool = False) -> None:
        super().__init__()
        self.tp, self.entered = tp, entered
        spec = ShardSpec(0, groups)
        self.weight = _cut(full.weight, spec, tp)
        self.bias = _cut(full.bias, spec, tp) if full.bias is not None else None

    def forward(self, x: torch.Tensor, chunk: torch.Tensor | None = None) -> torch.Tensor:
        """``chunk`` (with ``entered`` under sequence parallelism): this rank's part of the
        sequence ``x`` was gathered from, which the weight gradient is computed from."""
        tp = self.tp
        sp = tp.active and tp.sequence_parallel
        if not self.entered:
            chunk = x if sp else None
            x = regions.into_column(x, tp)
        if not sp or chunk is None:
            return F.linear(x, self.weight, self.bias)
        # Sequence parallel, as Megatron keeps it: the input gradient through the gathered
        # sequence (a GEMM with the weight detached saves no input), the weight gradient in a
        # branch of its own that saves this rank's chunk and gathers it again in its backward,
        # so the gathered sequence is not held from F to B, and I and W stay apart.
        y = F.linear(x, self.weight.detach(), self.bias)
        return y + _ChunkWeightGrad.apply(chunk, self.weight, y.shape, tp)


class _ChunkWeightGrad(torch.autograd.Function):
    """Adds nothing in the forward (a zero view of the output's shape); its backward gives the
    weight gradient ``g^T x`` from the sequence gathered again from the saved chunk."""

    @staticmethod
    def forward(ctx, chunk, weight, shape, tp):
        ctx.save_for_backward(chunk)
        ctx.tp = tp
        return chunk.new_zeros(()).expand(shape)

    @staticmethod
    def backward(ctx, g):
        (chunk,) = ctx.saved_tensors
        # Detached: an unpacked input carries its grad_fn, and the collective's work (gloo's
        # worker thread, NCCL's until it completes) would hold the stage's whole graph, and every
        # tensor it saved, a while past this W.
        full = regions.all_gather_sequence(chunk.detach(), ctx.tp)
        dw = g.reshape(-1, g.shape[-1]).t().mm(full.reshape(-1, full.shape[-1]))
        return None, dw, None, None


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
                             tp: TensorParallel, padding_idx: int | None = None) -> torch.Tensor:
    """The rows of ``tokens`` in this rank's ``weight`` (its vocabulary range), summed over
    tp: the full embedding on every rank (before any sequence scatter). ``padding_idx``: the
    global row that gets no gradient (`nn.Embedding`'s)."""
    if not tp.active:
        return F.embedding(tokens, weight, padding_idx)
    lo, hi = vocab_range(vocab, tp)
    outside = (tokens < lo) | (tokens >= hi)
    local = (tokens - lo).masked_fill(outside, 0)
    pad = padding_idx - lo if padding_idx is not None and lo <= padding_idx < hi else None
    out = F.embedding(local, weight, pad).masked_fill(outside.unsqueeze(-1), 0.0)
    return regions.reduce_from(out, tp)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, tp, vocab_start):
        # logits: (n, v/tp) fp32 on each rank; target: (n,) global ids
        logits_max = logits.max(dim=-1).values
        tp.wait(torch.distributed.all_reduce(logits_max, op=torch.distributed.ReduceOp.MAX,
                                              group=tp.group, async_op=True))
        shifted = logits - logits_max.unsqueeze(-1)
        v_local = logits.shape[-1]
        outside = (target < vocab_start) | (target >= vocab_start + v_local)
        local_t = (target - vocab_start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        both = torch.stack([picked, sum_exp])
        tp.wait(torch.distributed.all_reduce(both, group=tp.group, async_op=True))
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
