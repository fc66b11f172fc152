"""AdamW on the fp32 master weights, warm-up + cosine learning rate, global-norm clipping.

The learning rate is a pure function of the iteration (linear warm-up from lr/warmup to lr, then
cosine down to min_lr over ``decay_steps``), so resuming needs only the iteration. Biases and
normalisation weights (1-d parameters) get no weight decay, as in Megatron and GPT-2.
Parameters are handed over with their global names (``layers.<i>.<name>``) so optimizer state
can be keyed by name, not by position, for resharding.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def lr_at(step: int, *, lr: float, min_lr: float, warmup: int, decay_steps: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based)."""
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    span = max(1, decay_steps - warmup)
    t = min(1.0, (step - warmup) / span)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * t))


def build_adamw(named_masters: Sequence[tuple[str, torch.nn.Parameter]], *, lr: float,
                weight_decay: float, betas: tuple[float, float], eps: float,
                decays: Sequence[bool] | None = None) -> torch.optim.AdamW:
    """AdamW over the masters. CPU: the per-parameter loop (``foreach=False``; the same numbers
    as torch's default there). CUDA: ``fused=True``, one kernel for all parameters (the loop
    would launch several kernels per parameter, and read ``step`` on the host each time).
    ``decays``: per master whether it takes weight decay (default: 2-d and larger do), for
    masters that are flat pieces of parameters (the ZeRO shards, `pipeexec.training.zero`)."""
    if decays is None:
        decays = [p.dim() >= 2 for _, p in named_masters]
    decay = [p for (_, p), d in zip(named_masters, decays) if d]
    no_decay = [p for (_, p), d in zip(named_masters, decays) if not d]
    groups = [g for g in ({"params": decay, "weight_decay": weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    if not groups:   # a rank without parameters still steps (nothing), keeping ranks in lock-step
        groups = [{"params": [torch.nn.Parameter(torch.zeros(0))], "weight_decay": 0.0}]
    on_cuda = any(p.is_cuda for g in groups for p in g["params"])
    if on_cuda:
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=False)


def adamw_state_for(optimizer: torch.optim.Optimizer, param: torch.Tensor, state: dict) -> dict:
    """A loaded per-parameter AdamW state placed where this optimizer keeps it: moments on the
    parameter's device; ``step`` on the CPU (as torch creates it) unless the group is fused or
    capturable, which keep it on the device. A CUDA ``step`` with the per-parameter loop would
    cost one device sync per parameter per step."""
    group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
    on_device = bool(group.get("fused") or group.get("capturable"))
    out = {}
    for k, v in state.items():
        if not torch.is_tensor(v):
            out[k] = v
        elif k == "step":
            out[k] = v.detach().to("cpu" if not on_device else param.device).clone()
        else:
            out[k] = v.detach().to(param.device).clone()
    return out


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """Factor to multiply gradients by so that their global norm is at most ``max_norm``."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
