"""What fraction of peak FLOP/s a GEMM reaches: the plan's efficiency model.

Achieved throughput grows with the GEMMs' size per GPU and saturates. The model uses the
per-GPU width of the layer's matrices, ``w = hidden / tp``:

    efficiency(w) = e_max * w / (w + w_half)

``e_max`` and ``w_half`` were fitted once, for A100, to the eight iteration times of Korthikanti
et al. 2022, Table 5 (see ``benchmarks/plan_vs_published.py``, which refits and prints them):
``e_max = 0.80``, ``w_half = 470`` (largest error 2.5%). The same curve is used for the other presets until they are
calibrated (newer GPUs usually reach a lower fraction of a higher peak: pass a measured
``efficiency`` in the plan, or use :mod:`pipesim.calibrate` on a measured run). A plan's
``efficiency`` (a constant) overrides the model.
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
    """The fitted curve (A100's for every preset until others are fitted)."""
    return A100_FIT
