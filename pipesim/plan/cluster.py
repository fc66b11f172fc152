"""`Cluster`: the GPUs a plan runs on, their links, and which link each parallel group crosses.

Ranks are placed as a launcher places them: global ranks contiguous, ``domain`` GPUs to an
NVLink domain (8 in an HGX node, 72 in a GB200/GB300 NVL72 rack), in Megatron-LM's order
(``RankGenerator``, "tp-cp-ep-dp-pp"): tensor-parallel ranks fastest, then context, data and
pipeline parallel. A group of ``size`` ranks at ``stride`` (tp: stride 1; cp: tp; dp: tp*cp;
pp: tp*cp*dp; ep, in the expert layout tp-ep-dp-pp: tp) is priced from where its members
are (:func:`group_placement`): inside one domain it runs on NVLink; across domains on the
network, as NCCL's rail-aligned rings and trees run there, each member's channel leaving its
domain on its own NIC, so the ring's bus bandwidth is the lesser of NVLink's and the NICs of
the group's members in a domain (the domain holding the fewest members bounds it); the
latency counts the hops inside and across domains. Of a kind's groups, the slowest prices it
(every group of a kind runs at once, in step).

A link carries the hardware's measured per-collective figures for its kind
(``Hardware.collectives``), which :mod:`pipesim.plan.collectives` prefers to everything else;
a hardware with an NCCL tuner class (``Hardware.nccl_arch``: the GPU presets) is priced with
NCCL's tuner (:mod:`pipesim.plan.nccl`), a hardware file without one (``pipeexec
calibrate-hardware``'s) by its own measured pair. A cluster override of a link's latency or
bandwidth replaces them all (the override is the link: the plain alpha-beta ring).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, fields, replace
from functools import lru_cache
from typing import Any

from ..errors import PlanError
from ..fields import typed_fields
from ..hardware import Hardware, get_hardware
from .parallelism import Parallelism


@dataclass(frozen=True)
class Link:
    """What a collective sees: per-message latency (s), bandwidth per direction (bytes/s), and
    measured figures of single collectives where the hardware has them."""

    kind: str           # "intra" (NVLink domain) or "inter" (network)
    latency: float      # per message; across domains the network's
    bandwidth: float    # the bus bandwidth a ring reaches (NCCL's convention)
    # ((collective, group size or 0 = any, latency, bandwidth), ...): Hardware.collectives
    collectives: tuple = ()
    nodes: int = 1      # NVLink domains the group spans (> 1: NCCL's tree is an option)
    per_domain: int = 0     # the fewest members of the group in one domain (0: p / nodes)
    local_latency: float | None = None      # NVLink's pair, for the hops inside a domain
    local_bandwidth: float | None = None    # (None: the link's own)
    nic_bandwidth: float | None = None      # one GPU's network bus bandwidth (None: bandwidth)
    arch: str = ""      # NCCL tuner class (pipesim.plan.nccl.ARCHS); "": the plain ring
    nvls: bool = False  # NVLink SHARP (Hopper / Blackwell NVSwitch)
    nvlinks: int = 18   # NVLinks a GPU (NCCL's channels: two a link, at most 32)

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


# A pure function of four integers that a search asks for each group of every plan it
# derives (the same few dozen layouts each time): computed once per distinct layout.
@lru_cache(maxsize=4096)
def group_placement(stride: int, size: int, world: int, domain: int) -> tuple[int, int]:
    """``(domains, fewest members in one)`` of the slowest group of ``size`` ranks ``stride``
    apart among ``world`` ranks placed ``domain`` to an NVLink domain in order: the one with
    the fewest members in some domain (its ring's bottleneck), then the most domains. Groups
    start at ``b * stride * size + o`` (``o < stride``); two whose starts agree modulo
    ``domain`` are placed alike, so at most ``domain`` distinct ones are counted."""
    if size <= 1 or world <= domain:
        return 1, max(1, size)
    span = stride * size
    starts = {(b * span + o) % domain for b in range(min(max(1, world // span), domain))
              for o in range(min(stride, domain))}
    worst = (1, size)
    for r0 in starts:
        counts = Counter((r0 + i * stride) // domain for i in range(size))
        here = (len(counts), min(counts.values()))
        if (here[0] > 1, -here[1], here[0]) > (worst[0] > 1, -worst[1], worst[0]):
            worst = here
    return worst


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

    def _nccl(self) -> dict[str, Any]:
        """The NCCL tuner's settings of the hardware's links, unless a link is overridden
        (the override is the link) or the hardware has no tuner class (a measured file)."""
        hw = self.hardware
        arch = hw.nccl_arch
        if not arch or any(getattr(self, f) is not None for f in (
                "intra_bandwidth", "intra_latency", "inter_bandwidth", "inter_latency")):
            return {}
        per_link = 50e9 if arch == "blackwell" else 25e9     # NVLink 5; NVLink 3 and 4
        return {"arch": arch, "nvls": arch in ("hopper", "blackwell"),
                "nvlinks": max(1, round(hw.link_bandwidth / per_link))}

    def intra(self) -> Link:
        """NVLink: the hardware's bandwidth at NCCL's bus efficiency (an override of the
        bandwidth is taken as the bus bandwidth, as nccl-tests report it)."""
        hw = self.hardware
        own = self.intra_latency is None and self.intra_bandwidth is None
        bw = (hw.link_bandwidth * hw.link_bus_efficiency if self.intra_bandwidth is None
              else self.intra_bandwidth)
        return Link("intra", hw.link_latency if self.intra_latency is None else self.intra_latency,
                    bw, hw.collective_figures("intra") if own else (), **self._nccl())

    def inter(self, nodes: int = 2, per_domain: int = 1) -> Link:
        """The network across ``nodes`` domains, ``per_domain`` members of the group (the
        fewest) in one: each member's channel on its own NIC(s) (``network_bandwidth`` a GPU,
        at NCCL's bus efficiency; an override is that figure), the ring's bus bandwidth the
        lesser of NVLink's and ``per_domain`` GPUs' network bandwidth."""
        hw = self.hardware
        own = self.inter_latency is None and self.inter_bandwidth is None
        nic = (hw.network_bandwidth * hw.network_bus_efficiency if self.inter_bandwidth is None
               else self.inter_bandwidth)
        local = self.intra()
        return Link("inter", hw.network_latency if self.inter_latency is None else self.inter_latency,
                    min(local.bandwidth, per_domain * nic),
                    hw.collective_figures("inter") if own else (), nodes=nodes,
                    per_domain=per_domain, local_latency=local.latency,
                    local_bandwidth=local.bandwidth, nic_bandwidth=nic, **self._nccl())

    def link(self, stride: int, size: int, world: int) -> Link:
        """The link a group of ``size`` ranks ``stride`` apart crosses, from where its members
        are placed (`group_placement`: the slowest of the kind's groups)."""
        nodes, per_domain = group_placement(stride, size, world, self.domain)
        if nodes == 1:
            return self.intra()
        return self.inter(nodes=nodes, per_domain=per_domain)

    def p2p_link(self, stride: int, size: int, world: int) -> Link:
        """The pipeline's link: a send between neighbours across domains leaves on the
        sender's own NIC(s), one GPU's network bandwidth whatever else the group holds."""
        link = self.link(stride, size, world)
        if link.nodes == 1 or link.nic_bandwidth is None:
            return link
        return replace(link, bandwidth=min(link.bandwidth, link.nic_bandwidth), per_domain=1)

    def group_links(self, par: Parallelism) -> dict[str, Link]:
        """The link each group crosses: tp, cp, dp (with cp: the gradient group), pp, ep, and
        edp, the experts' gradient group (Megatron's expert-data-parallel group: the dp x cp
        ranks holding the same experts, ``ep`` of the group apart, expert parallelism folded
        innermost over dp x cp)."""
        w, tp, cp, dp = par.world_size, par.tp, par.cp, par.dp
        edp = max(1, cp * dp // par.ep)
        return {
            "edp": self.link(tp * min(par.ep, cp * dp), edp, w),
            "tp": self.link(1, tp, w),
            "cp": self.link(tp, cp, w),
            "dp": self.link(tp, cp * dp, w),           # data x context: Megatron's grad group
            "pp": self.p2p_link(tp * cp * dp, par.pp, w),
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
        typed_fields(cls, data, "cluster", source, PlanError)
        if "hardware" not in data:
            raise PlanError(f"{source}: cluster has no 'hardware'")
        hw = data["hardware"]
        if isinstance(hw, dict):
            try:
                hw = Hardware(**hw)
            except TypeError as exc:
                raise PlanError(f"{source}: cluster.hardware: {exc}") from None
        return cls(**{**data, "hardware": hw})
