"""Accelerator presets: the handful of numbers a pipeline cost model needs from the hardware.

Figures are vendors' datasheet peaks (dense bf16 tensor-core FLOP/s, HBM capacity, link
bandwidth per direction). Achieved throughput is a fraction of peak; that fraction is the
``efficiency`` argument of :meth:`pipesim.CostModel.transformer`, not part of the preset.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Hardware:
    """One accelerator and its links.

    ``link_bandwidth`` is the intra-node (NVLink) bandwidth per direction, ``network_bandwidth``
    the inter-node bandwidth per GPU per direction (one InfiniBand NIC per GPU), both in bytes/s;
    ``link_latency`` / ``network_latency`` are per-message latencies in seconds.
    """

    name: str
    peak_flops: float          # dense bf16 FLOP/s
    memory_bytes: float        # HBM capacity
    link_bandwidth: float      # NVLink, bytes/s per direction
    network_bandwidth: float   # InfiniBand per GPU, bytes/s per direction
    hbm_bandwidth: float       # bytes/s, bounds the (memory-bound) optimizer step
    link_latency: float = 5e-6
    network_latency: float = 10e-6

    def to_dict(self) -> dict:
        return asdict(self)


GB = 1e9
GiB = 2**30

# A100 SXM 80GB: 312 TFLOP/s bf16 dense, NVLink3 600 GB/s total (300 per direction), HDR 200 Gb/s,
#   HBM2e 2.04 TB/s.
# H100 SXM: 989 TFLOP/s bf16 dense, NVLink4 900 GB/s total (450 per direction), NDR 400 Gb/s,
#   HBM3 3.35 TB/s.
# H200 SXM: same compute and NVLink as H100, 141 GB HBM3e at 4.8 TB/s.
_PRESETS = {
    "A100": Hardware("A100", 312e12, 80 * GB, 300 * GB, 25 * GB, 2.04e12),
    "H100": Hardware("H100", 989e12, 80 * GB, 450 * GB, 50 * GB, 3.35e12),
    "H200": Hardware("H200", 989e12, 141 * GB, 450 * GB, 50 * GB, 4.8e12),
}


def hardware_names() -> list[str]:
    return list(_PRESETS)


def get_hardware(name: "str | Hardware") -> Hardware:
    """Look up a preset by name (case-insensitive); a :class:`Hardware` passes through."""
    if isinstance(name, Hardware):
        return name
    preset = _PRESETS.get(str(name).upper())
    if preset is None:
        raise ValueError(f"unknown hardware preset {name!r}; known: {', '.join(_PRESETS)}")
    return preset
