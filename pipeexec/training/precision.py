"""Mixed precision with fp32 master weights, and dynamic loss scaling.

Megatron's Float16Module semantics: the model's layers hold 16-bit parameters and compute in 16
bits; the first stage casts floating inputs to 16 bits and the last stage's outputs go to the
loss in fp32 (the runtime does both). The optimizer owns fp32 master copies; gradients are
accumulated in fp32 (see ddp.GradBuffer); after each step the masters are copied back into the
16-bit parameters. For fp32 the masters *are* the model parameters (no copy).

fp16 uses a dynamic loss scale: when any gradient on any rank is inf/nan, every rank skips the
step (the caller reduces the check over all ranks), the scale backs off; after
``growth_interval`` good steps in a row it grows again.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(precision: str) -> torch.dtype:
    try:
        return DTYPE[precision]
    except KeyError:
        raise ValueError(f"precision must be one of {', '.join(DTYPE)}, got {precision!r}") from None


class MasterWeights:
    """fp32 masters for a list of model parameters (the parameters themselves for fp32)."""

    def __init__(self, model_params: Sequence[torch.nn.Parameter], dtype: torch.dtype) -> None:
        self.model_params = list(model_params)
        self.copies = dtype != torch.float32
        if self.copies:
            self.masters = [torch.nn.Parameter(p.detach().float().clone()) for p in self.model_params]
            for p in self.model_params:
                p.data = p.data.to(dtype)
        else:
            self.masters = self.model_params

    @torch.no_grad()
    def copy_to_model(self) -> None:
        if self.copies:
            for p, m in zip(self.model_params, self.masters):
                p.copy_(m)


class LossScaler:
    """Dynamic (fp16) or constant loss scale."""

    def __init__(self, *, dynamic: bool, initial: float = 2.0 ** 16, growth: float = 2.0,
                 backoff: float = 0.5, growth_interval: int = 1000, min_scale: float = 1.0) -> None:
        self.dynamic = dynamic
        self.scale = float(initial) if dynamic else 1.0
        self.growth, self.backoff = growth, backoff
        self.growth_interval, self.min_scale = growth_interval, min_scale
        self.good_steps = 0

    def update(self, found_inf: bool) -> None:
        if not self.dynamic:
            return
        if found_inf:
            self.scale = max(self.scale * self.backoff, self.min_scale)
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= self.growth

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "dynamic": self.dynamic}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
