"""Accelerator presets and hardware files: the numbers a pipeline cost model needs from a GPU.

Figures are vendors' datasheet peaks (dense bf16 tensor-core FLOP/s, HBM capacity, link
bandwidth per direction) plus what the per-operator time model (:mod:`pipesim.plan.operators`)
reads: a GEMM-efficiency curve by shape, ``eff(m, n, k) = gemm_e_max / (1 + gemm_dim_half
(1/m + 1/n + 1/k))`` (optionally the measured table it was fitted to), the fraction of HBM
bandwidth element-wise kernels reach, the flash-attention efficiency, a per-kernel launch
overhead, and the memory a GPU loses to the CUDA context, NCCL and workspaces (a reserve)
and to the allocator (a fragmentation factor). Each figure's source is in ``sources``;
``calibration`` says whether the efficiency figures were fitted or measured on this hardware
(``"fitted"``, ``"measured"``) or carried over from another GPU (``"extrapolated"``: every
figure printed from such a preset says so). ``nvlink_domain`` is how many GPUs one NVLink
(scale-up) domain joins (8 in an HGX node, 72 in a GB200 NVL72 rack); ``fp8_flops`` the dense
FP8 peak, for plans with fp8 GEMMs (0 where the GPU has no FP8 tensor cores: A100);
``ep_dispatchers`` the expert-parallel token dispatchers the system runs (DeepEP and HybridEP
need their kernels' GPUs and links), the ones ``pipesim plan`` searches by default.

``collectives`` holds measured figures per collective where one link's pair would not do: per
link kind (``intra``, ``inter``), per collective (``all_reduce``, ``reduce_scatter``,
``all_gather``, ``all_to_all``) and per group size, a latency and bandwidth in the ring
convention of :mod:`pipesim.plan.collectives` (``pipeexec calibrate-hardware`` fits them to a
gloo benchmark). In a file::

    "collectives": {"intra": {"all_reduce": {"2": {"latency": 3e-05, "bandwidth": 2e9},
                                             "4": {...}},
                              "all_to_all": {"latency": 4e-05, "bandwidth": 1e9}}}

(a collective given without group sizes applies at every size). Files without the key (every
file written before) load as before: each collective then runs on its link's pair.

A hardware file (JSON, ``Hardware.to_dict()``'s keys; ``pipeexec calibrate-hardware`` writes
one) is read wherever a preset name is: ``--hardware FILE`` / ``get_hardware("cpu.json")``.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from .units import GB, GiB

LINK_KINDS = ("intra", "inter")
NCCL_ARCHS = ("", "ampere", "hopper", "blackwell")      # pipesim.plan.nccl.ARCHS, or none
COLLECTIVE_NAMES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")
# Megatron's token dispatchers (megatron/core/transformer/moe/token_dispatcher.py): "alltoall"
# (MoEAlltoAllTokenDispatcher: NCCL all-to-all, one copy of a token an expert; Megatron's
# default, pipeexec's) or the flex dispatcher with its backend, "deepep" or "hybridep" (one
# copy a destination rank, and across NVLink domains one a destination domain, forwarded there
# over NVLink). Named here, where a GPU says which it runs (`Hardware.ep_dispatchers`);
# `pipesim.plan.parallelism` prices them (and re-exports the names).
EP_DISPATCHERS = ("alltoall", "deepep", "hybridep")


LOW_PRECISIONS = ("fp8", "mxfp8", "nvfp4")


def _precision_rows(value: Any, hw: str) -> tuple:
    """``precision_e_max`` as sorted ``(precision, e_max)`` rows, from a mapping or rows."""
    rows = value.items() if isinstance(value, dict) else value
    out = []
    for row in rows:
        if len(row) != 2:
            raise ValueError(f"hardware {hw}: a precision_e_max row is (precision, e_max), "
                             f"got {row!r}")
        name, e = row
        if name not in LOW_PRECISIONS:
            raise ValueError(f"hardware {hw}: precision_e_max: {name!r} is not one of "
                             f"{', '.join(LOW_PRECISIONS)} (bf16's is gemm_e_max)")
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not 0 < e <= 1:
            raise ValueError(f"hardware {hw}: precision_e_max.{name} must be a number in "
                             f"(0, 1], got {e!r}")
        out.append((str(name), float(e)))
    if len({r[0] for r in out}) != len(out):
        raise ValueError(f"hardware {hw}: precision_e_max names a precision twice")
    return tuple(sorted(out))


def _collective_rows(value: Any, hw: str) -> tuple:
    """``collectives`` as sorted rows ``(kind, name, p, latency, bandwidth)`` (``p`` 0: any
    group size), from the file's nested mapping or from rows; every figure checked."""
    if isinstance(value, dict):
        rows = []
        for kind, per_name in value.items():
            if not isinstance(per_name, dict):
                raise ValueError(f"hardware {hw}: collectives.{kind} must map collectives to "
                                 f"figures, got {per_name!r}")
            for name, entry in per_name.items():
                if not isinstance(entry, dict):
                    raise ValueError(f"hardware {hw}: collectives.{kind}.{name} must be "
                                     f"{{latency, bandwidth}} or {{group size: {{latency, "
                                     f"bandwidth}}}}, got {entry!r}")
                flat = "latency" in entry or "bandwidth" in entry
                for p, fig in ({"any": entry} if flat else entry).items():
                    where = f"collectives.{kind}.{name}" + ("" if flat else f".{p}")
                    if not isinstance(fig, dict) or set(fig) != {"latency", "bandwidth"}:
                        raise ValueError(f"hardware {hw}: {where} must be {{\"latency\": s, "
                                         f"\"bandwidth\": bytes/s}}, got {fig!r}")
                    try:
                        size = 0 if p == "any" else int(p)
                    except (TypeError, ValueError):
                        raise ValueError(f"hardware {hw}: {where}: the group size must be an "
                                         f"integer >= 2 (or the figure given without sizes), "
                                         f"got {p!r}") from None
                    rows.append((kind, name, size, fig["latency"], fig["bandwidth"]))
    else:
        rows = [tuple(r) for r in value]
    out = []
    for row in rows:
        if len(row) != 5:
            raise ValueError(f"hardware {hw}: a collectives row is (kind, name, group size, "
                             f"latency, bandwidth), got {row!r}")
        kind, name, p, lat, bw = row
        where = f"collectives.{kind}.{name}" + (f".{p}" if p else "")
        if kind not in LINK_KINDS:
            raise ValueError(f"hardware {hw}: collectives: link kind {kind!r} is not one of "
                             f"{', '.join(LINK_KINDS)}")
        if name not in COLLECTIVE_NAMES:
            raise ValueError(f"hardware {hw}: collectives.{kind}: {name!r} is not one of "
                             f"{', '.join(COLLECTIVE_NAMES)}")
        if not isinstance(p, int) or isinstance(p, bool) or (p != 0 and p < 2):
            raise ValueError(f"hardware {hw}: {where}: the group size must be an integer >= 2, "
                             f"got {p!r}")
        try:
            lat, bw = float(lat), float(bw)
        except (TypeError, ValueError):
            raise ValueError(f"hardware {hw}: {where}: latency and bandwidth must be numbers, "
                             f"got {lat!r}, {bw!r}") from None
        if not lat >= 0 or lat == float("inf"):
            raise ValueError(f"hardware {hw}: {where}: latency must be >= 0 s, got {lat!r}")
        if not bw > 0:
            raise ValueError(f"hardware {hw}: {where}: bandwidth must be > 0 bytes/s, got {bw!r}")
        out.append((kind, name, p, lat, bw))
    keys = [r[:3] for r in out]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"hardware {hw}: collectives: {dup[0]}.{dup[1]} is given twice for "
                         f"group size {dup[2] or 'any'}")
    return tuple(sorted(out))


def _dispatchers(value: Any, hw: str) -> tuple:
    """``ep_dispatchers`` as a tuple of known names, each once, at least one."""
    names = (value,) if isinstance(value, str) else tuple(value)
    unknown = [n for n in names if n not in EP_DISPATCHERS]
    if unknown or not names or len(set(names)) != len(names):
        raise ValueError(f"hardware {hw}: ep_dispatchers must list each of the dispatchers it "
                         f"runs once, from {', '.join(EP_DISPATCHERS)}; got {list(names)!r}")
    return tuple(str(n) for n in names)


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
    # NCCL's bus bandwidth over the link's raw bandwidth, each link (1: the figure is already
    # a bus bandwidth, as a measured file's): what a ring reaches of a link in bulk transfers
    link_bus_efficiency: float = 1.0
    network_bus_efficiency: float = 1.0
    nvlink_domain: int = 8           # GPUs one NVLink (scale-up) domain joins
    fp8_flops: float | None = None   # dense FP8 FLOP/s (default: twice peak_flops; 0: none)
    mxfp8_flops: float = 0.0         # dense MXFP8 (block-scaled, 1x32 E8M0) FLOP/s; 0: none
    nvfp4_flops: float = 0.0         # dense NVFP4 (block-scaled FP4, 1x16 E4M3) FLOP/s; 0: none
    fp32_flops: float | None = None  # fp32 (TF32 on GPUs) FLOP/s (default: half peak_flops)
    # -- the per-operator time model (pipesim.plan.operators) --------------------------------
    gemm_e_max: float = 0.74         # GEMM efficiency at large shapes (fraction of the peak)
    gemm_dim_half: float = 60.0      # the dimension at which one GEMM side costs a doubling
    gemm_table: tuple = ()           # measured ((m, n, k, efficiency), ...), the curve's data
    # GEMM efficiency at large shapes per low precision (fp8, mxfp8, nvfp4), of that
    # precision's own peak: ((precision, e_max), ...), in a file {"fp8": 0.55, ...}; a
    # precision not listed takes gemm_e_max (the bf16 / fp16 / fp32 figure)
    precision_e_max: tuple = ()
    # the routed experts' grouped GEMM: the fraction of a dense GEMM's efficiency (same shape)
    # each group reaches
    grouped_gemm_efficiency: float = 1.0
    # the dimension at which one side of a group costs a doubling (None: gemm_dim_half): small
    # per-expert GEMMs reach less of the tensor cores than dense GEMMs of the same shape
    grouped_dim_half: float | None = None
    # quantize / cast kernels (fp8, mxfp8, nvfp4 GEMM inputs): fraction of hbm_bandwidth they
    # reach (None: mem_efficiency)
    cast_efficiency: float | None = None
    mem_efficiency: float = 0.70     # fraction of hbm_bandwidth element-wise kernels reach
    flash_e_max: float = 0.70        # flash attention (fwd + bwd) at long sequences, head dim 128
    launch_overhead: float = 4e-6    # seconds a kernel costs beyond its roofline
    # bytes/s one GPU moves to or from host memory, each direction (activation offloading);
    # None: not known (a plan offloading activations there is refused)
    host_bandwidth: float | None = None
    # -- memory a GPU cannot give to tensors ------------------------------------------------
    memory_reserve: float | None = None  # CUDA context, NCCL, workspaces (None: min(4 GiB, 5%))
    fragmentation: float = 1.05          # caching allocator: bytes reserved per byte allocated
    calibration: str = "extrapolated"   # "fitted" / "measured" here, or "extrapolated"
    sources: tuple = ()                  # ((figure, where it comes from), ...)
    # measured per-collective links: ((kind, name, group size or 0 = any, latency, bandwidth),
    # ...), in a file a nested mapping (see the module's docstring); empty: the links' pairs
    collectives: tuple = ()
    # NCCL's tuner class of the GPU ("ampere", "hopper", "blackwell"): its collectives priced
    # with NCCL's tuner (pipesim.plan.nccl); "" (a measured file): by the links' own pairs
    nccl_arch: str = ""
    # the fraction of the GPU's compute a collective takes while it runs hidden under compute
    # (NCCL's kernels hold SMs and memory bandwidth; Calculon's processor_usage), per link kind;
    # 0 (files without them): overlapped communication costs the compute nothing
    link_processor_usage: float = 0.0
    network_processor_usage: float = 0.0
    # the expert-parallel token dispatchers this system runs (`EP_DISPATCHERS`): what the
    # planner searches by default. Files without the key: NCCL's all-to-all alone, which runs
    # wherever NCCL does (DeepEP and HybridEP need their kernels' GPUs and links, see _PRESETS)
    ep_dispatchers: tuple = ("alltoall",)

    def __post_init__(self) -> None:
        # JSON gives lists; keep the dataclass hashable (plans are compared and hashed)
        object.__setattr__(self, "gemm_table", tuple(tuple(float(x) for x in row)
                                                     for row in self.gemm_table))
        src = self.sources.items() if isinstance(self.sources, dict) else self.sources
        object.__setattr__(self, "sources", tuple((str(k), str(v)) for k, v in src))
        object.__setattr__(self, "collectives", _collective_rows(self.collectives, self.name))
        object.__setattr__(self, "precision_e_max", _precision_rows(self.precision_e_max,
                                                                    self.name))
        object.__setattr__(self, "ep_dispatchers", _dispatchers(self.ep_dispatchers, self.name))
        for f in ("peak_flops", "memory_bytes", "link_bandwidth", "network_bandwidth",
                  "hbm_bandwidth"):
            if not getattr(self, f) > 0:
                raise ValueError(f"hardware {self.name}: {f} must be > 0, got {getattr(self, f)!r}")
        for f in ("fp8_flops", "mxfp8_flops", "nvfp4_flops"):
            v = getattr(self, f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                  or not 0 <= v < float("inf")):
                raise ValueError(f"hardware {self.name}: {f} must be a finite number >= 0 "
                                 f"(0: no such tensor cores), got {v!r}")
        if self.cast_efficiency is not None and not 0 < self.cast_efficiency <= 1:
            raise ValueError(f"hardware {self.name}: cast_efficiency must be in (0, 1] or null, "
                             f"got {self.cast_efficiency!r}")
        for f in ("gemm_e_max", "mem_efficiency", "flash_e_max", "link_bus_efficiency",
                  "network_bus_efficiency", "grouped_gemm_efficiency"):
            if not 0 < getattr(self, f) <= 1:
                raise ValueError(f"hardware {self.name}: {f} must be in (0, 1], got "
                                 f"{getattr(self, f)!r}")
        h = self.host_bandwidth
        if h is not None and (isinstance(h, bool) or not isinstance(h, (int, float))
                              or not 0 < h < float("inf")):
            raise ValueError(f"hardware {self.name}: host_bandwidth must be a finite number > 0"
                             f" (bytes/s a direction) or null, got {h!r}")
        v = self.grouped_dim_half
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                              or not 0 < v < float("inf")):
            raise ValueError(f"hardware {self.name}: grouped_dim_half must be a finite number > 0"
                             f" or null (null: the dense gemm_dim_half), got {v!r}")
        if not self.fragmentation >= 1:
            raise ValueError(f"hardware {self.name}: fragmentation must be >= 1 (bytes the "
                             f"allocator holds per byte of tensors), got {self.fragmentation!r}")
        if self.memory_reserve is not None and not 0 <= self.memory_reserve < self.memory_bytes:
            raise ValueError(f"hardware {self.name}: memory_reserve must be in [0, memory_bytes),"
                             f" got {self.memory_reserve!r}")
        for f in ("link_processor_usage", "network_processor_usage"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
                raise ValueError(f"hardware {self.name}: {f} must be a number in [0, 1) (the "
                                 f"fraction of compute a hidden collective takes), got {v!r}")
        if self.nccl_arch not in NCCL_ARCHS:
            raise ValueError(f"hardware {self.name}: nccl_arch must be one of "
                             f"{', '.join(repr(a) for a in NCCL_ARCHS)}, got {self.nccl_arch!r}")
        if self.calibration not in ("fitted", "measured", "extrapolated"):
            raise ValueError(f"hardware {self.name}: calibration must be fitted, measured or "
                             f"extrapolated, got {self.calibration!r}")

    @property
    def reserve(self) -> float:
        """Bytes held for the CUDA context, NCCL and workspaces: given, else min(4 GiB, 5%)."""
        if self.memory_reserve is not None:
            return self.memory_reserve
        return min(4 * GiB, 0.05 * self.memory_bytes)

    @property
    def usable_memory(self) -> float:
        """Bytes of tensors that fit: capacity less the reserve, over the fragmentation."""
        return (self.memory_bytes - self.reserve) / self.fragmentation

    @property
    def extrapolated(self) -> bool:
        """True when the efficiency figures were not fitted or measured on this GPU."""
        return self.calibration == "extrapolated"

    def source(self, figure: str) -> str:
        return dict(self.sources).get(figure, "")

    def gemm_efficiency(self, m: float, n: float, k: float, precision: str = "bf16",
                        grouped: bool = False) -> float:
        """Fraction of the precision's peak a GEMM of this shape reaches (the fitted curve);
        ``grouped``: one group of the routed experts' grouped GEMM (its own dim-half)."""
        d = self.gemm_dim_half
        if grouped and self.grouped_dim_half is not None:
            d = max(d, self.grouped_dim_half)
        return self.precision_gemm_e_max(precision) / (1.0 + d * (1.0 / m + 1.0 / n + 1.0 / k))

    def with_(self, **changes: Any) -> "Hardware":
        return replace(self, **changes)

    def collective_figures(self, kind: str) -> tuple:
        """The measured per-collective figures of link ``kind`` ("intra" or "inter"):
        ``((name, group size or 0 = any, latency, bandwidth), ...)`` (empty: none measured)."""
        return tuple(r[1:] for r in self.collectives if r[0] == kind)

    def with_links_scaled(self, factor: float) -> "Hardware":
        """These figures with every link bandwidth (both links' and each collective's) times
        ``factor``."""
        return replace(self, link_bandwidth=self.link_bandwidth * factor,
                       network_bandwidth=self.network_bandwidth * factor,
                       collectives=tuple((k, n, p, lat, bw * factor)
                                         for k, n, p, lat, bw in self.collectives))

    @property
    def fp8_peak_flops(self) -> float:
        return 2 * self.peak_flops if self.fp8_flops is None else self.fp8_flops

    @property
    def fp32_peak_flops(self) -> float:
        return self.peak_flops / 2 if self.fp32_flops is None else self.fp32_flops

    @property
    def has_fp8(self) -> bool:
        """Whether the GPU has FP8 tensor cores (A100 has none)."""
        return self.fp8_peak_flops > 0

    def fp8_refusal(self) -> str:
        """Why an fp8 plan cannot run here ('' when it can)."""
        return self.precision_refusal("fp8")

    def precision_peak(self, precision: str) -> float:
        """Dense tensor-core FLOP/s of GEMMs in ``precision`` (0: no such tensor cores)."""
        if precision in ("bf16", "fp16"):
            return self.peak_flops
        if precision == "fp32":
            return self.fp32_peak_flops
        if precision == "fp8":
            return self.fp8_peak_flops
        if precision == "mxfp8":
            return self.mxfp8_flops
        if precision == "nvfp4":
            return self.nvfp4_flops
        raise ValueError(f"hardware {self.name}: no peak for precision {precision!r}")

    def precision_gemm_e_max(self, precision: str) -> float:
        """GEMM efficiency at large shapes in ``precision``, of that precision's peak."""
        return dict(self.precision_e_max).get(precision, self.gemm_e_max)

    def precision_refusal(self, precision: str) -> str:
        """Why a plan with GEMMs in ``precision`` cannot run here ('' when it can)."""
        if precision in ("bf16", "fp16", "fp32") or self.precision_peak(precision) > 0:
            return ""
        which = {"fp8": "FP8 tensor cores; {n} has none (H100 and later do)",
                 "mxfp8": "block-scaled MXFP8 tensor cores; {n} has none (Blackwell's B200, "
                          "B300, GB200 and GB300 have them)",
                 "nvfp4": "NVFP4 tensor cores; {n} has none (Blackwell's B200, B300, GB200 "
                          "and GB300 have them)"}[precision].format(n=self.name)
        return f"precision {precision} needs {which}: use bf16" + (
            " or fp8" if precision != "fp8" and self.has_fp8 else "")

    def to_dict(self) -> dict:
        out = asdict(self)
        out["gemm_table"] = [list(r) for r in self.gemm_table]
        if self.precision_e_max:
            out["precision_e_max"] = dict(self.precision_e_max)
        else:
            del out["precision_e_max"]                 # files stay as they were without it
        out["sources"] = dict(self.sources)
        if self.collectives:
            nested: dict = {}
            for kind, name, p, lat, bw in self.collectives:
                nested.setdefault(kind, {}).setdefault(name, {})[str(p) if p else "any"] = {
                    "latency": lat, "bandwidth": bw}
            for per_name in nested.values():
                for name, entry in per_name.items():
                    if list(entry) == ["any"]:          # one figure for every group size
                        per_name[name] = entry["any"]
            out["collectives"] = nested
        else:
            del out["collectives"]                     # files stay as they were without them
        for f in ("grouped_dim_half", "host_bandwidth"):
            if out[f] is None:
                del out[f]                             # files stay as they were without them
        for f in ("nccl_arch", "link_processor_usage", "network_processor_usage"):
            if not out[f]:
                del out[f]                             # files without them stay as they were
        if self.ep_dispatchers == ("alltoall",):
            del out["ep_dispatchers"]                  # files without it stay as they were
        else:
            out["ep_dispatchers"] = list(self.ep_dispatchers)
        return out

    @classmethod
    def from_dict(cls, data: dict, source: str = "hardware") -> "Hardware":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{source}: unknown hardware field(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        try:
            return cls(**data)
        except TypeError as exc:
            raise ValueError(f"{source}: {exc}") from None

    @classmethod
    def load(cls, path: "str | Path") -> "Hardware":
        """A hardware file: JSON with this dataclass's fields (name and the five peaks required)."""
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"--hardware {path}: cannot read a hardware file: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"--hardware {path}: a hardware file is a JSON object")
        return cls.from_dict(data, source=str(path))

    def save(self, path: "str | Path") -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


H200_CUDA_BYTES = 150_109_880_320.0      # total_memory of an H200 (measured, see below)

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
# Memory: an HBM stack's "GB" is a binary gigabyte (A100's and H100's 80 GB are five 16 GiB
#   stacks; nvidia-smi shows 81,920 MiB on an A100 80GB), so capacities are read as GiB; the
#   H200's is what CUDA reports on one (torch.cuda.get_device_properties().total_memory,
#   measured by pipeexec calibrate-hardware, 2026-12-04: 139.8 GiB of its 141, the driver
#   keeping the rest). The 4 GiB reserve covers the CUDA context (0.75 GiB measured on that
#   H200), NCCL's buffers and the workspaces.
# The time model's figures for A100 were fitted once (benchmarks/bench_cost_model.py --fit) on
# the two tables kept for fitting (every other published run is a check): Korthikanti et al. 2022 Table 5 and Narayanan et al. 2021
# (SC21) Table 1, both Megatron-LM on A100 80GB. Other GPUs carry them over (calibration
# "extrapolated": a hardware file measured there replaces them), gemm_e_max scaled by a
# matmul microbenchmark (_MAMF below), and the figures with a source of their own.
A100_FIT = dict(gemm_e_max=0.74, gemm_dim_half=30.0, mem_efficiency=0.70)
# NCCL's bus bandwidth of a link, by GPU generation (NVIDIA/nccl src/graph/topo.h, commit
# 5067397: SM80_NVLINK_BW 20.0, SM90_NVLINK_BW 20.6, SM100_NVLINK_BW 40.1 GB/s a link; NET_BW
# 12.0 GB/s for 100 Gbit/s) over the raw per-direction link: NVLink 3 and 4 25 GB/s a link,
# NVLink 5 50 GB/s.
_BUS = dict(link_bus_efficiency=0.80, network_bus_efficiency=0.96)
_BUS_BY_GPU = {"H100": (0.824, "SM90_NVLINK_BW 20.6 GB/s a link of NVLink 4's 25"),
               "H200": (0.824, "SM90_NVLINK_BW 20.6 GB/s a link of NVLink 4's 25"),
               "B200": (0.802, "SM100_NVLINK_BW 40.1 GB/s a link of NVLink 5's 50"),
               "GB200": (0.802, "SM100_NVLINK_BW 40.1 GB/s a link of NVLink 5's 50"),
               "B300": (0.802, "SM100_NVLINK_BW 40.1 GB/s a link of NVLink 5's 50"),
               "GB300": (0.802, "SM100_NVLINK_BW 40.1 GB/s a link of NVLink 5's 50"),
               "MI300X": (0.80, "assumed as NCCL's A100 figure (RCCL over Infinity Fabric "
                                "has no such constant)")}
# NCCL's tuner rows by compute capability (SM80 Ampere, SM90 Hopper, SM100 Blackwell); MI300X
# runs RCCL, whose tuner is not transcribed: its links' pairs price it
_NCCL_ARCH = {"A100": "ampere", "H100": "hopper", "H200": "hopper", "B200": "blackwell",
              "GB200": "blackwell", "B300": "blackwell", "GB300": "blackwell"}
# Calculon's processor_usage (calculon-ai/calculon, commit caa4b11, systems/a100_80g.json and
# h100_80g_nvl8.json): a collective hidden under compute slows it as if it held this fraction
# of the GPU (calculon/llm/layers.py: flop_time / (1 - processor_usage) while both run);
# NVLink 0.15 (NCCL's kernels move the data through SMs), InfiniBand 0.02 (the NIC's DMA does)
_CALCULON = ("Calculon (calculon-ai/calculon caa4b11), systems/{}: processor_usage 0.15 on "
             "NVLink, 0.02 on InfiniBand")
_PROCESSOR_USAGE = {
    "A100": ((0.15, 0.02), _CALCULON.format("a100_80g.json")),
    "H100": ((0.15, 0.02), _CALCULON.format("h100_80g_nvl8.json")),
    "H200": ((0.15, 0.02), _CALCULON.format("h100_80g_nvl8.json") + ", as H100 (same SMs)"),
    "B200": ((0.15, 0.02), _CALCULON.format("h100_80g_nvl8.json") + ", H100's assumed"),
    "GB200": ((0.15, 0.02), _CALCULON.format("h100_80g_nvl8.json") + ", H100's assumed"),
    "B300": ((0.15, 0.02), _CALCULON.format("h100_80g_nvl8.json") + ", H100's assumed"),
    "GB300": ((0.15, 0.02), _CALCULON.format("h100_80g_nvl8.json") + ", H100's assumed"),
    "MI300X": ((0.15, 0.02), _CALCULON.format("h100_80g_nvl8.json") + ", H100's assumed "
               "(RCCL)"),
}
_A100_SOURCES = {
    "gemm_e_max": "fitted on Korthikanti et al. 2022 Table 5 + Narayanan et al. 2021 Table 1",
    "gemm_dim_half": "fitted on Korthikanti et al. 2022 Table 5 + Narayanan et al. 2021 Table 1",
    "mem_efficiency": "fitted on Korthikanti et al. 2022 Table 5 + Narayanan et al. 2021 Table 1",
    "flash_e_max": "Dao 2023, FlashAttention-2, Fig. 4: forward+backward on A100 reaches "
                   "about 70% of peak at head dim 128, long sequences",
    "launch_overhead": "order of a CUDA kernel launch (a few microseconds); assumed, not fitted",
    "memory_reserve": "CUDA context with cuBLAS/cuDNN kernels (~0.5-1 GiB), NCCL buffers "
                      "(NCCL_BUFFSIZE 4 MiB per channel and peer, ~1-2 GiB across "
                      "communicators), cuBLAS / Transformer Engine workspaces: 4 GiB default",
    "fragmentation": "PyTorch caching allocator: reserved over allocated, ~5% default",
    "peaks": "vendor datasheet (see the comment above _PRESETS)",
    "memory_bytes": "vendor datasheet, the HBM's GB read as GiB (H200: what CUDA reports on "
                    "one, measured)",
    "fp8_flops": "vendor datasheet, dense (A100: none; the default is twice the bf16 peak)",
    "mxfp8_flops": "none: block-scaled MXFP8 tensor cores are Blackwell's (B200 and later)",
    "nvfp4_flops": "none: NVFP4 tensor cores are Blackwell's (B200 and later)",
    "fp32_flops": "TF32 dense: half the bf16 dense peak on every datasheet listed",
    "grouped_dim_half": "null: a group's shape costs what a dense GEMM's does (gemm_dim_half;"
                        " assumed where no MoE run was fitted)",
    "grouped_gemm_efficiency": "1: a grouped GEMM's groups as fast as dense GEMMs of their "
                               "shape (assumed, where no MoE run was fitted)",
    "nvlink_domain": "8 GPUs an HGX / DGX node's NVSwitches join (GB200: its NVL72 rack, 72)",
    "link_latency": "assumed, not measured: 5 us a ring step inside a node (the order of "
                    "NCCL's per-step latency over NVLink)",
    "network_latency": "assumed, not measured: 10 us a ring step across nodes (InfiniBand RDMA "
                       "and NCCL's network proxy)",
    "link_bus_efficiency": "NCCL's NVLink bus bandwidth over the raw link: SM80_NVLINK_BW 20.0 "
                           "GB/s a link (NVIDIA/nccl src/graph/topo.h) of NVLink 3's 25 GB/s per "
                           "direction, 0.80",
    "network_bus_efficiency": "NCCL's NET_BW 12.0 GB/s for a 100 Gbit/s NIC (12.5 GB/s; "
                              "NVIDIA/nccl src/graph/topo.h), 0.96",
}
_CARRIED = {k: "carried over from A100's fit (extrapolated; measure with pipeexec "
               "calibrate-hardware and pass --hardware FILE)" for k in A100_FIT}


def _carried_e_max(name: str) -> float:
    """A100's fitted gemm_e_max scaled by ``name``'s MAMF over A100's (see _MAMF)."""
    return round(A100_FIT["gemm_e_max"] * _MAMF[name] / _MAMF["A100"], 3)


def _preset(name: str, *args: float, calibration: str = "extrapolated",
            sources: dict | None = None, **kw: Any) -> Hardware:
    src = dict(_A100_SOURCES)
    if calibration == "extrapolated":
        src.update(_CARRIED)
    if name in _MAMF and name != "A100":
        kw.setdefault("gemm_e_max", _carried_e_max(name))
        src["gemm_e_max"] = (f"A100's fitted {A100_FIT['gemm_e_max']} x {name}'s measured matmul "
                             f"efficiency over A100's, {_MAMF[name]:.1%} / {_MAMF['A100']:.1%} "
                             "(Bekman, ml-engineering MAMF table, bf16; derived from a "
                             "microbenchmark, not fitted)")
    if name in _BUS_BY_GPU:
        eff, why = _BUS_BY_GPU[name]
        kw.setdefault("link_bus_efficiency", eff)
        src["link_bus_efficiency"] = (f"NCCL's NVLink bus bandwidth over the raw link: {why} "
                                      f"(NVIDIA/nccl src/graph/topo.h), {eff}")
    if name in _HOST:
        kw.setdefault("host_bandwidth", _HOST[name][0])
        src["host_bandwidth"] = _HOST[name][1]
    if name in _DISPATCHERS:
        kw.setdefault("ep_dispatchers", _DISPATCHERS[name][0])
        src["ep_dispatchers"] = _DISPATCHERS[name][1]
    if name in _NCCL_ARCH:
        kw.setdefault("nccl_arch", _NCCL_ARCH[name])
        src["nccl_arch"] = (f"NCCL's tuner class of the GPU ({_NCCL_ARCH[name]}: its compute "
                            "capability's row in NVIDIA/nccl src/graph/tuning.cc)")
    usage, why = _PROCESSOR_USAGE.get(name, _PROCESSOR_USAGE["H100"])
    kw.setdefault("link_processor_usage", usage[0])
    kw.setdefault("network_processor_usage", usage[1])
    src["link_processor_usage"] = src["network_processor_usage"] = why
    src.update(sources or {})
    kw.setdefault("memory_reserve", 4 * GiB)
    return Hardware(name, *args, **{**A100_FIT, **_BUS, **kw}, calibration=calibration,
                    sources=tuple(src.items()))


# GEMM efficiency of the other GPUs: A100's fitted gemm_e_max scaled by the ratio of their
# measured best-shape matmul efficiencies (S. Bekman, "Machine Learning Engineering",
# compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison table", bf16,
# torch matmul, mean of 100 iterations; stas00/ml-engineering commit 744d01e): A100 SXM 86.9%,
# H100 SXM 80.3% ("H200 is the same"), B200 SXM 77.6%, GB200 72.9%, MI300X 51.4%. A
# microbenchmark, not an end-to-end run: published training runs stay checks of the model.
# Low-precision peaks of the Blackwell presets, dense (the datasheets give 2:4-sparse figures
# for FP8 and both for FP4): block-scaled MXFP8 runs at the FP8 rate, NVFP4 at the FP4 one.
_BLACKWELL_PEAKS = {
    "B200": {"mxfp8_flops": "NVIDIA HGX B200 datasheet (2024): 72 PFLOP/s FP8 with sparsity for "
                            "8 GPUs, 4.5 PFLOP/s dense a GPU (MXFP8 at the FP8 rate)",
             "nvfp4_flops": "NVIDIA HGX B200 datasheet (2024): 144 PFLOP/s FP4 with sparsity for "
                            "8 GPUs, 9 PFLOP/s dense a GPU"},
    "B300": {"peaks": "NVIDIA HGX B300 datasheet (2025): per GPU as B200 in BF16 (2.25 PFLOP/s "
                      "dense) and FP8 (4.5); 288 GB HBM3e at 8 TB/s; NVLink 5 1.8 TB/s; "
                      "ConnectX-8 800 Gb/s a GPU",
             "mxfp8_flops": "NVIDIA HGX B300 datasheet (2025): 72 PFLOP/s FP8 with sparsity for "
                            "8 GPUs, 4.5 PFLOP/s dense a GPU (MXFP8 at the FP8 rate)",
             "nvfp4_flops": "NVIDIA HGX B300 datasheet (2025): FP4 144 PFLOP/s sparse | 105 "
                            "PFLOP/s dense for 8 GPUs, 13.125 PFLOP/s dense a GPU"},
    "GB200": {"mxfp8_flops": "NVIDIA GB200 NVL72 datasheet (2024): 720 PFLOP/s FP8 with sparsity "
                             "for 72 GPUs, 5 PFLOP/s dense a GPU (MXFP8 at the FP8 rate)",
              "nvfp4_flops": "NVIDIA GB200 NVL72 datasheet (2024): 1,440 PFLOP/s FP4 with "
                             "sparsity for 72 GPUs, 10 PFLOP/s dense a GPU"},
    "GB300": {"peaks": "NVIDIA GB300 NVL72 datasheet (2025): 360 PFLOP/s FP16/BF16 with sparsity "
                       "for 72 GPUs (2.5 PFLOP/s dense a GPU), HBM3e 288 GB a GPU at 8 TB/s, one "
                       "NVLink 5 domain of 72 GPUs, ConnectX-8 800 Gb/s a GPU",
              "mxfp8_flops": "NVIDIA GB300 NVL72 datasheet (2025): 720 PFLOP/s FP8 with sparsity "
                             "for 72 GPUs, 5 PFLOP/s dense a GPU (MXFP8 at the FP8 rate)",
              "nvfp4_flops": "NVIDIA GB300 NVL72 datasheet (2025): FP4 1,440 PFLOP/s sparse | "
                             "1,080 PFLOP/s dense for 72 GPUs, 15 PFLOP/s dense a GPU"},
}

# GPU <-> host memory, bytes/s a direction a GPU (activation offloading): the host link of each
# datasheet; PCIe's raw rate (x16 lanes: Gen4 32 GB/s, Gen5 64 GB/s a direction)
_PCIE4, _PCIE5 = 32 * GB, 64 * GB
_C2C = 225 * GB
_HOST = {
    "A100": (_PCIE4, "PCIe Gen4 x16, 32 GB/s a direction (A100 SXM datasheet: PCIe Gen4 64 GB/s)"),
    "H100": (_PCIE5, "PCIe Gen5 x16, 64 GB/s a direction (H100 SXM datasheet: PCIe Gen5 "
                     "128 GB/s)"),
    "H200": (_PCIE5, "PCIe Gen5 x16, 64 GB/s a direction (as H100 SXM)"),
    "B200": (_PCIE5, "PCIe Gen5 x16, 64 GB/s a direction (DGX B200: Gen5 host links)"),
    "B300": (_PCIE5, "assumed as B200's PCIe Gen5 x16, 64 GB/s a direction"),
    "GB200": (_C2C, "NVLink-C2C 900 GB/s both directions a Grace CPU, shared by its two GPUs "
                    "(GB200 NVL72 datasheet): 225 GB/s a GPU a direction"),
    "GB300": (_C2C, "NVLink-C2C 900 GB/s both directions a Grace CPU, shared by its two GPUs "
                    "(GB300 NVL72 datasheet): 225 GB/s a GPU a direction"),
    "MI300X": (_PCIE5, "PCIe Gen5 x16, 64 GB/s a direction (MI300X data sheet: PCIe Gen5 "
                       "128 GB/s)"),
}

# The expert-parallel dispatchers each system runs (Megatron-Core's --moe-token-dispatcher-type
# alltoall, or flex with --moe-flex-dispatcher-backend deepep / hybridep). DeepEP
# (deepseek-ai/DeepEP README, commit dd758ca, "Requirements"): Hopper (SM90) GPUs or others
# with SM90 PTX ISA support, NVLink inside a node and an RDMA network across nodes; its
# performance table lists SM90 and SM100 (B200) GPUs; A100 only inside a node (the README's
# roadmap, hybrid-ep branch 94a9f8f). HybridEP (DeepEP's hybrid-ep branch, NVIDIA's TMA
# kernels): Megatron-Core's MoE README (NVIDIA/Megatron-LM d98e8a6, megatron/core/transformer/
# moe/README.md, "MCore v0.15": "HybridEP backend to Flex Dispatcher (GB200, B200, H100
# supported)"). On NVL72 racks (one NVLink domain over 18 trays: multi-node NVLink, MNNVL)
# HybridEP alone: Megatron-Core's TransformerConfig.moe_flex_dispatcher_backend ("Currently
# only 'hybridep' backend supports the MNNVL case"). Both are CUDA kernels: MI300X runs the
# all-to-all alone.
_MCORE_HYBRIDEP = ("Megatron-Core MoE README (NVIDIA/Megatron-LM d98e8a6): HybridEP \"GB200, "
                   "B200, H100 supported\"")
_DEEPEP = ("DeepEP README (deepseek-ai/DeepEP dd758ca): SM90 GPUs, NVLink in a node, RDMA "
           "across nodes")
_DISPATCHERS = {
    "A100": (("alltoall",), "all-to-all only: HybridEP lists no Ampere GPU (" + _MCORE_HYBRIDEP
             + "); DeepEP runs on A100 inside a node only (DeepEP's roadmap, hybrid-ep branch "
             "94a9f8f), which an EP group across nodes cannot use"),
    "H100": (EP_DISPATCHERS, _DEEPEP + "; " + _MCORE_HYBRIDEP),
    "H200": (EP_DISPATCHERS, "as H100 (Hopper, SM90): " + _DEEPEP + "; " + _MCORE_HYBRIDEP),
    "B200": (EP_DISPATCHERS, _DEEPEP + ", its performance table SM100 (B200) as well; "
             + _MCORE_HYBRIDEP),
    "B300": (EP_DISPATCHERS, "as B200 (Blackwell): HybridEP in Megatron-Bridge's B300 MoE "
             "recipes (scripts/performance/configs, v0.4.2: DeepSeek-V3, Qwen3, GPT-OSS); "
             "DeepEP assumed as on B200"),
    "GB200": (("alltoall", "hybridep"), "NVL72 (multi-node NVLink): Megatron-Core "
              "TransformerConfig.moe_flex_dispatcher_backend, \"only 'hybridep' backend "
              "supports the MNNVL case\"; " + _MCORE_HYBRIDEP),
    "GB300": (("alltoall", "hybridep"), "NVL72 (multi-node NVLink) as GB200: only HybridEP of "
              "the flex backends (Megatron-Core TransformerConfig.moe_flex_dispatcher_backend); "
              "HybridEP in Megatron-Bridge's GB300 MoE recipes (v0.4.2)"),
    "MI300X": (("alltoall",), "all-to-all only: DeepEP and HybridEP are CUDA kernels (NVLink, "
               "TMA); RCCL's all-to-all runs"),
}

_MAMF = {"A100": 0.869, "H100": 0.803, "H200": 0.803, "B200": 0.776, "GB200": 0.729,
         "MI300X": 0.514}

_PRESETS = {
    "A100": _preset("A100", 312e12, 80 * GiB, 300 * GB, 25 * GB, 2.04e12, fp8_flops=0.0,
                    calibration="fitted"),
    "H100": _preset("H100", 989e12, 80 * GiB, 450 * GB, 50 * GB, 3.35e12, flash_e_max=0.55,
                    sources={"flash_e_max": "Shah et al. 2024, FlashAttention-3: FA2 reaches "
                             "35-40% of H100's peak, FA3 bf16 forward up to 75%; backward "
                             "lower: 55% assumed for fwd+bwd"}),
    "H200": _preset("H200", 989e12, H200_CUDA_BYTES, 450 * GB, 50 * GB, 4.8e12, flash_e_max=0.55,
                    sources={"flash_e_max": "as H100 (same SMs and clocks)"}),
    "B200": _preset("B200", 2.25e15, 180 * GiB, 900 * GB, 50 * GB, 8e12, fp8_flops=4.5e15,
                    mxfp8_flops=4.5e15, nvfp4_flops=9e15,
                    flash_e_max=0.55, sources={"flash_e_max": "as H100 (assumed)",
                                               **_BLACKWELL_PEAKS["B200"]}),
    "B300": _preset("B300", 2.25e15, 288 * GiB, 900 * GB, 100 * GB, 8e12, fp8_flops=4.5e15,
                    mxfp8_flops=4.5e15, nvfp4_flops=13.125e15, flash_e_max=0.55,
                    gemm_e_max=_carried_e_max("B200"),
                    sources={"flash_e_max": "as H100 (assumed)", **_BLACKWELL_PEAKS["B300"],
                             "gemm_e_max": "as B200's (the same bf16 tensor-core rate; not in "
                                           "the MAMF table): assumed"}),
    "GB200": _preset("GB200", 2.5e15, 186 * GiB, 900 * GB, 50 * GB, 8e12, nvlink_domain=72,
                     fp8_flops=5e15, mxfp8_flops=5e15, nvfp4_flops=10e15, flash_e_max=0.55,
                     sources={"flash_e_max": "as H100 (assumed)", **_BLACKWELL_PEAKS["GB200"]}),
    "GB300": _preset("GB300", 2.5e15, 288 * GiB, 900 * GB, 100 * GB, 8e12, nvlink_domain=72,
                     fp8_flops=5e15, mxfp8_flops=5e15, nvfp4_flops=15e15, flash_e_max=0.55,
                     gemm_e_max=_carried_e_max("GB200"),
                     sources={"flash_e_max": "as H100 (assumed)", **_BLACKWELL_PEAKS["GB300"],
                              "gemm_e_max": "as GB200's (the same bf16 tensor-core rate; not in "
                                            "the MAMF table): assumed"}),
    "MI300X": _preset("MI300X", 1307.4e12, 192 * GiB, 448 * GB, 50 * GB, 5.3e12,
                      fp8_flops=2614.9e12, flash_e_max=0.45,
                      sources={"flash_e_max": "assumed below H100's (ROCm flash attention)"}),
}
_ALIASES = {"GB200-NVL72": "GB200", "GB200_NVL72": "GB200", "NVL72": "GB200",
            "GB300-NVL72": "GB300", "GB300_NVL72": "GB300", "DGX-H100": "H100",
            "DGX-B200": "B200", "DGX-B300": "B300", "DGX-GB200": "GB200", "DGX-GB300": "GB300"}


# -- figures fitted on published runs -----------------------------------------------------------
# pipesim/data/fitted.json: per GPU, the time model's figures fitted on NVIDIA Megatron-Bridge's
# published runs by `python3 benchmarks/bench_published.py --fit` (the file names its source
# and command); they replace the presets' carried-over figures (calibration "fitted").
FITTED_FILE = Path(__file__).parent / "data" / "fitted.json"
FITTED_FORMAT = "pipesim.fitted/1"
_FITTABLE = ("gemm_e_max", "precision_e_max", "mem_efficiency", "flash_e_max",
             "grouped_gemm_efficiency", "grouped_dim_half")
_DIMENSIONS = ("grouped_dim_half",)     # fitted figures that are sizes, not fractions


# the fitted file's optional ``check``: how far the fit's predictions land from the published
# runs when each model family is left out of the fit (the honest score), by kind of model
CHECK_KINDS = ("dense", "moe")


def read_fitted(path: "str | Path" = FITTED_FILE) -> dict:
    """The fitted-figures file, checked: ``{"format", "source", "command", "gpus": {GPU:
    {figure: value, "precision_e_max": {precision: value}}}, "check": {"dense" | "moe":
    {"runs", "median", "worst"}}}`` (``check`` optional); {} when there is none."""
    p = Path(path)
    if not p.exists():
        return {}
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{p}: cannot read the fitted figures: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FITTED_FORMAT:
        raise ValueError(f"{p}: not a {FITTED_FORMAT} file (its 'format')")
    for key in ("source", "command"):
        if not isinstance(data.get(key), str) or not data[key]:
            raise ValueError(f"{p}: '{key}' must name where the figures come from")
    gpus = data.get("gpus")
    if not isinstance(gpus, dict):
        raise ValueError(f"{p}: 'gpus' must map GPU presets to their figures")
    for gpu, figs in gpus.items():
        if gpu not in _PRESETS or not isinstance(figs, dict):
            raise ValueError(f"{p}: gpus.{gpu}: not a preset ({', '.join(_PRESETS)}) with a "
                             "mapping of figures")
        for fig, value in figs.items():
            if fig not in _FITTABLE:
                raise ValueError(f"{p}: gpus.{gpu}.{fig}: not a fitted figure "
                                 f"({', '.join(_FITTABLE)})")
            values = value.values() if fig == "precision_e_max" and isinstance(value, dict) \
                else [value]
            for v in values:
                if fig in _DIMENSIONS:
                    if isinstance(v, bool) or not isinstance(v, (int, float)) or \
                            not 0 < v < float("inf"):
                        raise ValueError(f"{p}: gpus.{gpu}.{fig}: a finite number > 0, got {v!r}")
                elif isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
                    raise ValueError(f"{p}: gpus.{gpu}.{fig}: a number in (0, 1], got {v!r}")
    check = data.get("check", {})
    if not isinstance(check, dict):
        raise ValueError(f"{p}: 'check' must map {' / '.join(CHECK_KINDS)} to their scores")
    for kind, score in check.items():
        if kind not in CHECK_KINDS or not isinstance(score, dict) or \
                set(score) != {"runs", "median", "worst"}:
            raise ValueError(f"{p}: check.{kind}: one of {', '.join(CHECK_KINDS)} with 'runs', "
                             "'median' and 'worst'")
        runs = score["runs"]
        if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
            raise ValueError(f"{p}: check.{kind}.runs: a whole number >= 1, got {runs!r}")
        for field in ("median", "worst"):
            v = score[field]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                raise ValueError(f"{p}: check.{kind}.{field}: a finite fraction >= 0, got {v!r}")
        if score["median"] > score["worst"]:
            raise ValueError(f"{p}: check.{kind}: median {score['median']} exceeds worst "
                             f"{score['worst']}")
    return data


def published_check(hardware: "Hardware", moe: bool) -> "dict | None":
    """How far pipesim's tokens/s/GPU landed from the published runs the fitted figures come
    from, each model family predicted by a fit without its own runs (``{"runs", "median",
    "worst"}``, fractions), for a model of this kind on a GPU the file fits; None elsewhere."""
    if hardware.name not in FITTED.get("gpus", {}) or hardware.calibration != "fitted":
        return None
    return FITTED.get("check", {}).get("moe" if moe else "dense")


def published_check_note(hardware: "Hardware", moe: bool) -> str:
    """'' or a line saying how far to trust the absolute times: :func:`published_check`."""
    check = published_check(hardware, moe)
    if check is None:
        return ""
    return (f"checked on published runs: {'MoE' if moe else 'dense'} models' tokens/s/GPU "
            f"within {check['median']:.1%} at the median, {check['worst']:.1%} at worst, each "
            f"model family predicted by figures fitted without its own runs ({check['runs']} "
            "runs of NVIDIA's Megatron-Bridge performance summary; docs/planning.md)")


def _apply_fitted(presets: dict, data: dict) -> dict:
    out = dict(presets)
    for gpu, figs in data.get("gpus", {}).items():
        hw = out[gpu]
        where = f"fitted on {data['source']} ({data['command']}; pipesim/data/fitted.json)"
        src = dict(hw.sources)
        for fig in figs:
            src[fig] = where
        changes = {k: v for k, v in figs.items() if k != "precision_e_max"}
        if "precision_e_max" in figs:
            changes["precision_e_max"] = {**dict(hw.precision_e_max), **figs["precision_e_max"]}
        out[gpu] = hw.with_(**changes, calibration="fitted", sources=tuple(src.items()))
    return out


_BEFORE_FIT = dict(_PRESETS)
FITTED = read_fitted()
_PRESETS = _apply_fitted(_BEFORE_FIT, FITTED)


def preset_before_fit(name: str) -> Hardware:
    """A preset as defined here, before the fitted file's figures (what a refit starts from)."""
    key = str(name).upper()
    return _BEFORE_FIT[_ALIASES.get(key, key)]


def hardware_names() -> list[str]:
    return list(_PRESETS)


def get_hardware(name: "str | Hardware") -> Hardware:
    """Look up a preset by name (case-insensitive), or read a hardware file (a path ending in
    .json, or an existing file); a :class:`Hardware` passes through."""
    if isinstance(name, Hardware):
        return name
    if str(name).endswith(".json") or Path(str(name)).is_file():
        return Hardware.load(name)
    key = str(name).upper()
    preset = _PRESETS.get(_ALIASES.get(key, key))
    if preset is None:
        raise ValueError(f"unknown hardware preset {name!r}; known: {', '.join(_PRESETS)}, or a "
                         "hardware file (.json, from pipeexec calibrate-hardware)")
    return preset
