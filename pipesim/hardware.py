"""Accelerator presets: the handful of numbers a pipeline cost model needs from the hardware.

Figures are vendors' datasheet peaks (dense bf16 tensor-core FLOP/s, HBM capacity, link
bandwidth per direction). Achieved throughput is a fraction of peak; that fraction is the
``efficiency`` argument of :meth:`pipesim.CostModel.transformer` (or a plan's efficiency model,
:mod:`pipesim.plan.efficiency`), not part of the preset. ``nvlink_domain`` is how many GPUs one
NVLink (scale-up) domain joins (8 in an HGX node, 72 in a GB200 NVL72 rack); ``fp8_flops`` the
dense FP8 peak, for plans with fp8 GEMMs (0 where the GPU has no FP8 tensor cores: A100).
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
    nvlink_domain: int = 8           # GPUs one NVLink (scale-up) domain joins
    fp8_flops: float | None = None   # dense FP8 FLOP/s (default: twice peak_flops; 0: none)

    @property
    def fp8_peak_flops(self) -> float:
        return 2 * self.peak_flops if self.fp8_flops is None else self.fp8_flops

    @property
    def has_fp8(self) -> bool:
        """Whether the GPU has FP8 tensor cores (A100 has none)."""
        return self.fp8_peak_flops > 0

    def fp8_refusal(self) -> str:
        """Why an fp8 plan cannot run here ('' when it can)."""
        return "" if self.has_fp8 else (f"precision fp8 needs FP8 tensor cores; {self.name} has "
                                        "none (H100 and later do): use bf16")

    def to_dict(self) -> dict:
        return asdict(self)


GB = 1e9
GiB = 2**30

# A100 SXM 80GB: 312 TFLOP/s bf16 dense, NVLink3 600 GB/s total (300 per direction), HDR 200 Gb/s,
#   HBM2e 2.04 TB/s; no FP8 (Ampere's tensor cores stop at bf16/fp16/tf32 and int8).
# H100 SXM: 989 TFLOP/s bf16 dense, NVLink4 900 GB/s total (450 per direction), NDR 400 Gb/s,
#   HBM3 3.35 TB/s.
# H200 SXM: same compute and NVLink as H100, 141 GB HBM3e at 4.8 TB/s.
# B200 (NVIDIA HGX B200 / DGX B200 datasheet, 2024): 8 GPUs give 36 PFLOP/s FP16/BF16 and
#   72 PFLOP/s FP8 *with sparsity*, so 2.25 PFLOP/s bf16 and 4.5 PFLOP/s fp8 dense per GPU;
#   1,440 GB HBM3e (180 GB a GPU) at 8 TB/s; NVLink 5 1.8 TB/s total (900 GB/s per direction);
#   ConnectX-7 400 Gb/s per GPU.
# GB200 NVL72 (NVIDIA GB200 NVL72 datasheet, 2024): 72 GPUs give 360 PFLOP/s FP16/BF16 and
#   720 PFLOP/s FP8 with sparsity (2.5 / 5 PFLOP/s dense per GPU); 13.4 TB HBM3e (186 GB a
#   GPU) at 8 TB/s; one NVLink 5 domain of 72 GPUs at 1.8 TB/s total per GPU; 400 Gb/s NICs.
# MI300X (AMD Instinct MI300X data sheet, 2023): 1,307.4 TFLOP/s bf16 and 2,614.9 TFLOP/s
#   fp8 dense; 192 GB HBM3 at 5.3 TB/s; 7 Infinity Fabric links of 128 GB/s (64 per
#   direction) to the other 7 GPUs of the node, 448 GB/s per direction in all; 400 Gb/s NICs.
_PRESETS = {
    "A100": Hardware("A100", 312e12, 80 * GB, 300 * GB, 25 * GB, 2.04e12, fp8_flops=0.0),
    "H100": Hardware("H100", 989e12, 80 * GB, 450 * GB, 50 * GB, 3.35e12),
    "H200": Hardware("H200", 989e12, 141 * GB, 450 * GB, 50 * GB, 4.8e12),
    "B200": Hardware("B200", 2.25e15, 180 * GB, 900 * GB, 50 * GB, 8e12, fp8_flops=4.5e15),
    "GB200": Hardware("GB200", 2.5e15, 186 * GB, 900 * GB, 50 * GB, 8e12, nvlink_domain=72,
                      fp8_flops=5e15),
    "MI300X": Hardware("MI300X", 1307.4e12, 192 * GB, 448 * GB, 50 * GB, 5.3e12,
                       fp8_flops=2614.9e12),
}
_ALIASES = {"GB200-NVL72": "GB200", "GB200_NVL72": "GB200", "NVL72": "GB200"}


def hardware_names() -> list[str]:
    return list(_PRESETS)


def get_hardware(name: "str | Hardware") -> Hardware:
    """Look up a preset by name (case-insensitive); a :class:`Hardware` passes through."""
    if isinstance(name, Hardware):
        return name
    key = str(name).upper()
    preset = _PRESETS.get(_ALIASES.get(key, key))
    if preset is None:
        raise ValueError(f"unknown hardware preset {name!r}; known: {', '.join(_PRESETS)}")
    return preset
