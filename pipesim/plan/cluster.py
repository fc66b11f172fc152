"""`Cluster`: the GPUs a plan runs on, their links, and which link each parallel group crosses.

Ranks are laid out as Megatron-LM orders them (``RankGenerator`` with order "tp-cp-ep-dp-pp"):
tensor-parallel ranks fastest, then context, data and pipeline parallel. A group of ``size``
ranks at ``stride`` (tp: stride 1; cp: tp; dp: tp*cp; pp: tp*cp*dp; ep, in the expert layout
tp-ep-dp-pp: tp) stays inside one NVLink domain when its span ``stride * size`` fits in the
domain and divides it; otherwise it crosses the network (a ring over the network runs at one
NIC's bandwidth per GPU).

A link carries the hardware's measured per-collective figures for its kind
(``Hardware.collectives``), which :mod:`pipesim.plan.collectives` prefers to the link's own
pair; a cluster override of that link's latency or bandwidth replaces them too (the override
is the link).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from ..errors import PlanError
from ..fields import known_fields
from ..hardware import Hardware, get_hardware
from .parallelism import Parallelism


@dataclass(frozen=True)
class Link:
    """What a collective sees: per-message latency (s), bandwidth per direction (bytes/s), and
    measured figures of single collectives where the hardware has them."""

    kind: str           # "intra" (NVLink domain) or "inter" (network)
    latency: float
    bandwidth: float    # the bus bandwidth a ring reaches (NCCL's convention)
    # ((collective, group size or 0 = any, latency, bandwidth), ...): Hardware.collectives
    collectives: tuple = ()
    nodes: int = 1      # NVLink domains the group spans (> 1: NCCL's tree is an option)

    def measured(self, name: str) -> bool:
        """Whether collective ``name`` has a measured figure on this link."""
        return any(n == name for n, *_ in self.collectives)

    def figure(self, name: str, p: int) -> tuple[float, float]:
        """``(latency, bandwidth)`` of collective ``name`` over ``p`` ranks: the figure measured
        at ``p``; else one given for any size; else the one measured at the nearest size (the
        larger of two as near); else the link's own pair."""
        rows = [(size, lat, bw) for n, size, lat, bw in self.collectives if n == name]
        if not rows:
            return self.latency, self.bandwidth
        exact = [r for r in rows if r[0] == p] or [r for r in rows if r[0] == 0]
        if exact:
            return exact[0][1], exact[0][2]
        _, lat, bw = min(rows, key=lambda r: (abs(r[0] - p), -r[0]))
        return lat, bw


@dataclass(frozen=True)
class Cluster:
    hardware: Hardware
    gpus_per_node: int = 8
    nvlink_domain: int | None = None        # default: the hardware's (72 for GB200 NVL72)
    intra_bandwidth: float | None = None    # overrides of the hardware's links
    intra_latency: float | None = None
    inter_bandwidth: float | None = None
    inter_latency: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.hardware, str) or isinstance(self.hardware, dict):
            hw = (get_hardware(self.hardware) if isinstance(self.hardware, str)
                  else Hardware(**self.hardware))
            object.__setattr__(self, "hardware", hw)
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise PlanError(f"cluster.gpus_per_node: must be a positive integer, got "
                            f"{self.gpus_per_node!r}")
        if self.nvlink_domain is not None and (not isinstance(self.nvlink_domain, int)
                                               or self.nvlink_domain < 1):
            raise PlanError(f"cluster.nvlink_domain: must be a positive integer, got "
                            f"{self.nvlink_domain!r}")
        for f in ("intra_bandwidth", "inter_bandwidth"):
            v = getattr(self, f)
            if v is not None and not v > 0:
                raise PlanError(f"cluster.{f}: must be > 0 bytes/s, got {v!r}")
        for f in ("intra_latency", "inter_latency"):
            v = getattr(self, f)
            if v is not None and not v >= 0:
                raise PlanError(f"cluster.{f}: must be >= 0 s, got {v!r}")

    @property
    def domain(self) -> int:
        """GPUs joined by NVLink: given, else the larger of a node and the hardware's domain."""
        if self.nvlink_domain is not None:
            return self.nvlink_domain
        hw = self.hardware.nvlink_domain
        return hw if hw > self.gpus_per_node else self.gpus_per_node

    def intra(self) -> Link:
        """NVLink: the hardware's bandwidth at NCCL's bus efficiency (an override of the
        bandwidth is taken as the bus bandwidth, as nccl-tests report it)."""
        hw = self.hardware
        own = self.intra_latency is None and self.intra_bandwidth is None
        bw = (hw.link_bandwidth * hw.link_bus_efficiency if self.intra_bandwidth is None
              else self.intra_bandwidth)
        return Link("intra", hw.link_latency if self.intra_latency is None else self.intra_latency,
                    bw, hw.collective_figures("intra") if own else ())

    def inter(self, nodes: int = 2) -> Link:
        """The network, one NIC per GPU, at NCCL's bus efficiency; ``nodes``: the domains the
        group spans."""
        hw = self.hardware
        own = self.inter_latency is None and self.inter_bandwidth is None
        bw = (hw.network_bandwidth * hw.network_bus_efficiency if self.inter_bandwidth is None
              else self.inter_bandwidth)
        return Link("inter", hw.network_latency if self.inter_latency is None else self.inter_latency,
                    bw, hw.collective_figures("inter") if own else (), nodes=nodes)

    def link(self, stride: int, size: int, world: int) -> Link:
        """The link a group of ``size`` ranks ``stride`` apart crosses."""
        span = stride * size
        d = self.domain
        inside = size == 1 or world <= d or (span <= d and d % span == 0)
        if inside:
            return self.intra()
        # ranks of the group inside one domain: those less than a domain apart
        per_domain = max(1, min(size, d // stride)) if stride < d else 1
        return self.inter(nodes=max(2, -(-size // per_domain)))

    def group_links(self, par: Parallelism) -> dict[str, Link]:
        """The link each group crosses: tp, cp, dp (with cp: the gradient group), pp, ep."""
        w, tp, cp, dp = par.world_size, par.tp, par.cp, par.dp
        return {
            "tp": self.link(1, tp, w),
            "cp": self.link(tp, cp, w),
            "dp": self.link(tp, cp * dp, w),           # data x context: Megatron's grad group
            "pp": self.link(tp * cp * dp, par.pp, w),
            "ep": self.link(tp, par.ep, w),
        }

    def with_(self, **changes: Any) -> "Cluster":
        return replace(self, **changes)

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["hardware"] = self.hardware.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict, source: str = "cluster") -> "Cluster":
        known_fields(cls, data, "cluster", source, PlanError)
        if "hardware" not in data:
            raise PlanError(f"{source}: cluster has no 'hardware'")
        hw = data["hardware"]
        if isinstance(hw, dict):
            try:
                hw = Hardware(**hw)
            except TypeError as exc:
                raise PlanError(f"{source}: cluster.hardware: {exc}") from None
        return cls(**{**data, "hardware": hw})
