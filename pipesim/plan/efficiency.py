"""The one-curve efficiency model that preceded the per-operator one (kept for comparison).

Plans are now timed per operator (:mod:`pipesim.plan.operators`, with the hardware's figures,
:mod:`pipesim.hardware`); this curve of the per-GPU width ``w = hidden / tp``,

    efficiency(w) = e_max * w / (w + w_half)

(``e_max = 0.80``, ``w_half = 470``, fitted on Korthikanti et al. 2022 Table 5 alone) is what
``benchmarks/plan_vs_published.py --fit`` refits and what a plan used before; it cannot tell a
tp-1 model of hidden 2k from a tp-8 one of the same ``w`` (the per-operator model,
:mod:`pipesim.plan.operators`, can). A plan's constant ``efficiency`` still replaces the
per-operator model with FLOPs / (peak * efficiency).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Efficiency:
    e_max: float
    w_half: float

    def __call__(self, width: float) -> float:
        return self.e_max * width / (width + self.w_half)


A100_FIT = Efficiency(e_max=0.80, w_half=470.0)


def default_efficiency(hardware_name: str) -> Efficiency:
    """The old fitted curve (A100's, used for every preset): for comparison only."""
    return A100_FIT
