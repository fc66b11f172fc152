"""The routers' load-balancing (auxiliary) loss of a Hugging Face mixture-of-experts model
(Mixtral, Qwen2-MoE, Qwen3-MoE) through a pipeline, exactly as the family's ``*ForCausalLM``
computes it (``load_balancing_loss_func`` with ``output_router_logits = true``, no padding):

    aux = E * sum_e (C[e] / R) * (P[e] / R),      loss = lm_loss + router_aux_loss_coef * aux

over ALL the model's MoE layers: ``C[e]`` the top-k assignments to expert e (a histogram of the
top-k of softmax(router logits)), ``P[e]`` the sum of the softmax probabilities, ``R`` the rows
(tokens x MoE layers). C and P are sums over layers that live on different stages, so the loss
is no sum of per-stage terms: d aux / d P_layer = coef E C_total / R^2 needs every later
stage's counts. The statistics therefore travel with the activation:

* the embedding packs its hidden state with zero statistics, each decoder layer unpacks, adds
  its router's C, P, R (layers without a router add nothing) and packs again, the head adds
  ``coef * aux`` to the microbatch's loss (`head_output` / `split_head_output`);
* packed = the hidden state (batch, seq, h) with a few rows appended along the sequence
  (``extra_rows``), batch element 0's holding ``[P (E), C (E), R]`` as fp32 bits (a 16-bit
  activation carries each fp32 value in two elements, bit for bit; `_Unpack`'s backward
  builds the gradient by concatenation, never by an addition that could touch those bits),
  the others zero. Unpacking is a view (the hidden state is ``packed[:, :seq]``), packing one
  copy of the hidden state per layer. So the runtime sends ONE tensor as before and its backward
  sends dL/dP back to the earlier stages with the hidden state's gradient: autograd carries
  it. Nothing in the runtime or the schedules knows: every schedule, the split I/W backward
  and recomputation work on the packed tensor as on any other. P is differentiable, C, R and
  the shape are not;
* P is accumulated layer by layer in layer order from zero, as Hugging Face's loop does, so
  the sums are Hugging Face's bit for bit at tp 1, cp 1.

Tensor parallelism: each router reads the whole sequence (its input is the norm's output
after it entered the column region: all-gathered under sequence parallelism), so every tp
rank holds the same statistics and the same aux; the aux's gradient then flows into the router
weight (summed over tp after the backward) and into the norm output's column-region crossing
(summed over tp): each rank's share of it is 1/tp (`_ScaleGrad`). Context parallelism: each cp
rank's routers see its tokens; the head sums C, P, R over the cp group (`_SumOverGroup`:
forward all-reduce, backward all-reduce: every cp rank's loss holds the whole aux and the
trainer averages gradients over dp x cp, so the sum of the cp ranks' gradients, divided by cp,
is the aux's gradient once) and every cp rank adds the whole aux to its local-mean LM loss (the
logged loss, averaged over cp, is the mean LM loss plus ``coef * aux``).

The logged loss is the total, as Hugging Face's ``loss``. The head's output (the last stage's,
what a forward-only run keeps) is ``[logits.flatten() (fp32), coef * aux]``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..parallel import context
from ..parallel.context import ContextParallel
from ..parallel.regions import NONE, TensorParallel

_CARRIERS = (torch.float32, torch.bfloat16, torch.float16)
_FIXED = 1     # R after P and C


@dataclass(frozen=True)
class RouterLoss:
    """The aux loss of one model: ``experts`` (E), ``top_k``, ``coef``
    (``router_aux_loss_coef``), this rank's tp and cp groups."""

    experts: int
    top_k: int
    coef: float
    tp: TensorParallel = NONE
    cp: ContextParallel = context.NONE

    @property
    def width(self) -> int:
        """fp32 values of the statistics."""
        return 2 * self.experts + _FIXED

    # -- the packed activation ---------------------------------------------------------------
    def extra_rows(self, hidden_size: int, dtype: torch.dtype) -> int:
        """Sequence rows the statistics take in a packed activation."""
        return -(-self.width * _per(dtype) // hidden_size)

    def start(self, hidden: torch.Tensor) -> torch.Tensor:
        """The embedding's output: ``hidden`` (batch, seq, h) with zero statistics."""
        return self.pack(hidden, torch.zeros(self.width, dtype=torch.float32,
                                             device=hidden.device))

    def pack(self, hidden: torch.Tensor, side: torch.Tensor) -> torch.Tensor:
        """``hidden`` (batch, seq, h) and the statistics ``side`` as one tensor."""
        if hidden.dtype not in _CARRIERS:
            raise ValueError(f"router aux loss: activations of {hidden.dtype} cannot carry the "
                             f"statistics (fp32, bf16 or fp16)")
        b, _, h = hidden.shape
        bits = side if hidden.dtype == torch.float32 else _AsBits.apply(side, hidden.dtype)
        rows = self.extra_rows(h, hidden.dtype)
        tail = torch.cat([bits, bits.new_zeros(b * rows * h - bits.numel())]).view(b, rows, h)
        return torch.cat([hidden, tail], dim=1)

    def unpack(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden (batch, seq, h): a view, statistics (fp32, `width`)) of a packed
        activation."""
        if packed.dim() != 3 or packed.dtype not in _CARRIERS:
            raise ValueError(f"router aux loss: a layer got a {packed.dtype} tensor of shape "
                             f"{tuple(packed.shape)}, not the packed activation (batch, seq + "
                             f"statistics rows, hidden) the previous layer makes")
        rows = self.extra_rows(packed.shape[2], packed.dtype)
        if packed.shape[1] <= rows:
            raise ValueError(f"router aux loss: a packed activation of shape "
                             f"{tuple(packed.shape)} has no sequence besides its {rows} "
                             "statistics rows")
        return _Unpack.apply(packed, rows, self.width)

    def add_layer(self, side: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """``side`` with one MoE layer's router added: Hugging Face's loop body, no mask."""
        e = self.experts
        probs = torch.nn.functional.softmax(router_logits, dim=-1)
        _, selected = torch.topk(probs, self.top_k, dim=-1)
        cpu_like = probs.device.type in ("cpu", "mps")       # histc's dtypes, as HF picks them
        counts = torch.histc(selected.reshape(-1).to(torch.float32 if cpu_like else torch.int32),
                             bins=e, min=0, max=e)
        return torch.cat([side[:e] + probs.float().sum(dim=0), side[e:2 * e].detach() + counts,
                          side[2 * e:].detach() + probs.shape[0]])

    # -- the head ----------------------------------------------------------------------------
    def term(self, side: torch.Tensor) -> torch.Tensor:
        """``coef * aux`` of the whole microbatch (summed over cp; its gradient 1/tp a rank)."""
        e = self.experts
        stats = side[:2 * e + 1]
        if self.cp.active:
            stats = _SumOverGroup.apply(stats, self.cp)
        # (rows > 0: every decoder layer is a MoE layer, `hf_config` refuses dense ones)
        probs, counts, rows = stats[:e], stats[e:2 * e].detach(), stats[2 * e].detach()
        aux = torch.sum((counts / rows) * (probs / rows).unsqueeze(0)) * e
        out = self.coef * aux
        return _ScaleGrad.apply(out, 1.0 / self.tp.size) if self.tp.active else out

    def head_output(self, logits: torch.Tensor, side: torch.Tensor) -> torch.Tensor:
        """The last layer's one tensor: the logits (fp32) and ``coef * aux``."""
        return torch.cat([logits.float().reshape(-1), self.term(side).float().reshape(1)])


def split_head_output(output: torch.Tensor, targets: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits (batch, seq, vocab or its tp share), ``coef * aux``) of `head_output`."""
    n = output.numel() - 1
    return output[:n].view(*targets.shape, -1), output[n]


def _per(dtype: torch.dtype) -> int:
    """Elements of ``dtype`` one fp32 value takes."""
    return 4 // torch.empty((), dtype=dtype).element_size()


class _AsBits(torch.autograd.Function):
    """fp32 values as the elements of a 16-bit tensor, bit for bit (the gradient likewise)."""

    @staticmethod
    def forward(ctx, side: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return side.contiguous().view(dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.contiguous().view(torch.float32), None


def _bits_of(side: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return side if dtype == torch.float32 else side.contiguous().view(dtype)


class _Unpack(torch.autograd.Function):
    """packed -> (hidden, fp32 statistics); the backward concatenates the two gradients."""

    @staticmethod
    def forward(ctx, packed: torch.Tensor, rows: int, width: int):
        seq = packed.shape[1] - rows
        k = width * _per(packed.dtype)
        side = packed[0, seq:].reshape(-1)[:k].contiguous().view(torch.float32).clone()
        ctx.rows, ctx.dtype = rows, packed.dtype
        return packed[:, :seq], side

    @staticmethod
    def backward(ctx, grad_hidden: torch.Tensor, grad_side: torch.Tensor):
        b, _, h = grad_hidden.shape
        bits = _bits_of(grad_side.float(), ctx.dtype)
        tail = torch.cat([bits, bits.new_zeros(b * ctx.rows * h - bits.numel())])
        return torch.cat([grad_hidden, tail.view(b, ctx.rows, h)], dim=1), None, None


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) over the cp group; the backward all-reduces the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
        ctx.cp = cp
        return _all_reduce(x.clone(), cp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce(grad.clone(), ctx.cp), None


def _all_reduce(x: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    x = x.contiguous()
    cp.wait(dist.all_reduce(x, group=cp.group, async_op=True))
    return x


class _ScaleGrad(torch.autograd.Function):
    """Identity; the gradient times ``factor``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def router_loss_of(config, tp: TensorParallel = NONE,
                   cp: ContextParallel = context.NONE) -> RouterLoss | None:
    """The aux loss a transformers config asks for (``output_router_logits``), or None."""
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if not getattr(config, "output_router_logits", False) or not experts:
        return None
    return RouterLoss(int(experts), int(config.num_experts_per_tok),
                      float(config.router_aux_loss_coef), tp, cp)
