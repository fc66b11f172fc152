"""Alpha-beta (latency-bandwidth) times of the collectives a plan uses, ring algorithms.

For ``p`` ranks, ``n`` bytes (the whole tensor: the input of an all-reduce, the output of an
all-gather, the input of a reduce-scatter), per-message latency ``a`` and bandwidth ``B`` per
direction (Thakur, Rabenseifner & Gropp 2005; NCCL's "bus bandwidth" convention):

* all-reduce ``2 (p-1) a + 2 (p-1)/p * n / B``;
* all-gather, reduce-scatter ``(p-1) a + (p-1)/p * n / B``;
* all-to-all ``(p-1) a + (p-1)/p * n / B`` (each rank keeps 1/p of its ``n`` bytes);
* point-to-point ``a + n / B``.

All are zero when ``p == 1`` (or ``n == 0`` for point-to-point). ``B`` is the link's bus
bandwidth (`Cluster` applies NCCL's bus efficiency to the raw link; across NVLink domains the
lesser of NVLink's and the NICs of the group's members in a domain, rail-aligned).

On a GPU with an NCCL tuner class (``link.arch``: the presets), all-reduce, all-gather and
reduce-scatter take NCCL's own choice of algorithm (ring, tree, NVLS, NVLS tree, PAT) and
protocol (LL, LL128, Simple) and its time for it (:mod:`pipesim.plan.nccl`). An all-to-all
(NCCL's grouped sends and receives, no tuner) across domains sends the off-domain share of
its bytes, ``(p - p_local) / p``, over each GPU's own NICs and the on-domain share
``(p_local - 1) / p`` over NVLink, at once: the slower of the two, each with its own latency
per message (``p_local`` the fewest members of the group in one domain).

Megatron's flex dispatcher (DeepEP, HybridEP) sends a token once to each rank holding
some of its experts and once to each remote domain holding some (:func:`flex_dispatch`),
where the all-to-all dispatcher sends one copy an expert.

An all-reduce across NVLink domains (``link.nodes > 1``) may run NCCL's tree instead, and does
where the tree is faster, as NCCL's tuner picks (NVIDIA/nccl ``src/graph/tuning.cc``, commit
5067397, Simple protocol): latency ``2 ((ppn - 1) + log2(nodes))`` steps (``ppn`` the group's
ranks per domain) and bandwidth ``0.92 x 0.5`` of the bus bandwidth (``busBw * .92``, then the
tree's bus-to-algorithm ratio ``.5``), times NCCL's tree correction factor for the size
(``treeCorrectionFactor``, Simple row: 64 B to 256 MiB in powers of two). The tree wins on
latency (small messages across many nodes), the ring on bandwidth (large gradients).

``a`` and ``B`` are the link's pair, or the hardware's measured figure for that collective
at that group size where it has one (:meth:`pipesim.plan.cluster.Link.figure`; a hardware
file's ``collectives``, which ``pipeexec calibrate-hardware`` fits with :func:`fit` below to a
benchmark in this same convention).
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from .cluster import Link
from .nccl import nccl_time

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")


def factors(name: str, p: int) -> tuple[float, float]:
    """``(latency steps, bandwidth share)`` of ``name`` over ``p`` ranks: its time is
    ``steps * a + share * n / B`` (the ring convention above)."""
    if name not in COLLECTIVES:
        raise ValueError(f"unknown collective {name!r}; known: {', '.join(COLLECTIVES)}")
    k = 2 if name == "all_reduce" else 1
    return k * (p - 1), k * (p - 1) / p


# NCCL's treeCorrectionFactor, Simple protocol, for sizes 64 B x 2^i (src/graph/tuning.cc)
TREE_CORRECTION = (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8,
                   .7, .7, .8, .9, .9, .9)
TREE_BANDWIDTH = 0.92 * 0.5     # the tree's algorithm bandwidth over the bus bandwidth


def collective_time(name: str, nbytes: float, p: int, link: Link) -> float:
    """Seconds collective ``name`` of ``nbytes`` takes over ``p`` ranks on ``link``: its
    measured figure; else on a link with an NCCL tuner class NCCL's choice (an all-to-all its
    on- and off-domain shares); else the ring, or for an all-reduce across domains the faster
    of ring and tree."""
    if p <= 1 or nbytes <= 0:
        return 0.0
    if not link.measured(name):
        if name == "all_to_all" and link.nodes > 1:
            return hierarchical_all_to_all(nbytes, p, link)
        if link.arch and name != "all_to_all":
            return nccl_choice(name, nbytes, p, link).seconds
    steps, share = factors(name, p)
    latency, bandwidth = link.figure(name, p)
    ring = steps * latency + share * nbytes / bandwidth
    if name != "all_reduce" or link.nodes <= 1 or link.measured(name):
        return ring
    return min(ring, tree_all_reduce(nbytes, p, link))


def nccl_choice(name: str, nbytes: float, p: int, link: Link):
    """NCCL's tuner's pick (:class:`pipesim.plan.nccl.Choice`) for ``name`` on ``link``."""
    nodes = min(link.nodes, p)
    return nccl_time(name, nbytes, p, arch=link.arch, bus=link.bandwidth,
                     local_bus=link.bandwidth if link.local_bandwidth is None else link.local_bandwidth,
                     nodes=nodes, per_domain=link.per_domain or max(1, p // nodes),
                     links=link.nvlinks, nvls=link.nvls)


def hierarchical_all_to_all(nbytes: float, p: int, link: Link) -> float:
    """An all-to-all of ``nbytes`` a rank across NVLink domains: ``(p_local - 1) / p`` of them
    over NVLink and ``(p - p_local) / p`` over the rank's own NICs at the same time, each with
    a latency per message (``p_local``: the fewest members of the group in one domain)."""
    local = min(p, link.per_domain or max(1, p // max(1, link.nodes)))
    lat_l = link.latency if link.local_latency is None else link.local_latency
    bw_l = link.bandwidth if link.local_bandwidth is None else link.local_bandwidth
    bw_n = link.bandwidth if link.nic_bandwidth is None else link.nic_bandwidth
    on = (local - 1) * lat_l + (local - 1) / p * nbytes / bw_l
    off = (p - local) * link.latency + (p - local) / p * nbytes / bw_n
    return max(on, off)


def miss(experts: int, held: float, k: int) -> float:
    """The chance that a token's ``k`` experts, a uniformly random ``k``-subset of ``experts``
    (the summary's force-balanced routing draws the router's logits at random), all miss the
    ``held`` experts of one destination: ``C(E - x, k) / C(E, k)``."""
    out = 1.0
    for i in range(k):
        if experts - held - i <= 0:
            return 0.0
        out *= (experts - held - i) / (experts - i)
    return out


def flex_dispatch(nbytes: float, k: int, experts: int, p: int, link: Link) -> float:
    """One dispatch (or combine) of Megatron's flex token dispatcher (DeepEP, HybridEP) over
    ``p`` expert-parallel ranks, ``nbytes`` a rank's tokens (one copy of each): a token goes
    once to each rank holding some of its ``k`` experts (the all-to-all dispatcher sends one
    copy an expert), and across NVLink domains once to each remote domain holding some, over
    the rank's own NIC, to be forwarded inside that domain over NVLink (DeepEP's normal
    kernels, deepseek-ai/DeepEP README: "asymmetric-domain bandwidth forwarding ... from
    NVLink domain to RDMA domain"; DeepSeek-V3 technical report, section 3.2.2: IB once a
    node, then NVLink to the GPUs hosting the experts). One kernel writes to every peer at
    once: one message latency, not a ring's ``p - 1`` (DeepEP V1's normal kernels move 4,096
    tokens of 7,168 at 153-158 GB/s of H800's ~160 GB/s NVLink, docs/legacy.md, which leaves
    no room for a latency a peer). The forwarding runs under the network transfer; combine
    moves the same bytes back (reduced where they were forwarded)."""
    if p <= 1 or nbytes <= 0 or k <= 0:
        return 0.0
    ranks = 1 - miss(experts, experts / p, k)            # a destination rank is hit
    if link.measured("all_to_all"):
        return collective_time("all_to_all", p * ranks * nbytes, p, link)
    if link.nodes <= 1:
        return link.latency + (p - 1) * ranks * nbytes / link.bandwidth
    local = min(p, link.per_domain or max(1, p // max(1, link.nodes)))
    domains = max(1, round(p / local))
    lat_l = link.latency if link.local_latency is None else link.local_latency
    bw_l = link.bandwidth if link.local_bandwidth is None else link.local_bandwidth
    bw_n = link.bandwidth if link.nic_bandwidth is None else link.nic_bandwidth
    on = lat_l + (local - 1) * ranks * nbytes / bw_l
    remote = (domains - 1) * (1 - miss(experts, experts / domains, k))
    off = link.latency + remote * nbytes / bw_n
    return max(on, off)


def tree_all_reduce(nbytes: float, p: int, link: Link) -> float:
    """NCCL's double binary tree all-reduce over ``p`` ranks in ``link.nodes`` domains."""
    nodes = min(link.nodes, p)
    ppn = max(1, p // nodes)
    steps = 2 * ((ppn - 1) + math.ceil(math.log2(nodes)))
    i = int(math.log2(max(nbytes, 64) / 64))
    correction = TREE_CORRECTION[i] if i < len(TREE_CORRECTION) else 1.0
    return steps * link.latency + nbytes / (TREE_BANDWIDTH * correction * link.bandwidth)


def all_reduce(nbytes: float, p: int, link: Link) -> float:
    return collective_time("all_reduce", nbytes, p, link)


def all_gather(nbytes: float, p: int, link: Link) -> float:
    return collective_time("all_gather", nbytes, p, link)


def reduce_scatter(nbytes: float, p: int, link: Link) -> float:
    return collective_time("reduce_scatter", nbytes, p, link)


def all_to_all(nbytes: float, p: int, link: Link) -> float:
    return collective_time("all_to_all", nbytes, p, link)


def p2p(nbytes: float, link: Link) -> float:
    return 0.0 if nbytes <= 0 else link.latency + nbytes / link.bandwidth


@dataclass(frozen=True)
class Fit:
    """One collective's alpha-beta figures at one group size, fitted to measured times."""

    name: str
    p: int
    latency: float        # a, seconds per ring step
    bandwidth: float      # B, bytes/s

    def time(self, nbytes: float) -> float:
        """The fitted time of ``nbytes`` (the convention above)."""
        return collective_time(self.name, nbytes, self.p, Link("fit", self.latency, self.bandwidth))


def fit(points: Iterable[tuple[float, float]], name: str, p: int) -> Fit:
    """The ``(a, B)`` of ``steps * a + share * n / B`` closest to ``points`` ((bytes, seconds),
    sizes as the convention counts them) in relative error: least squares on ``t_fit / t - 1``,
    so a microsecond at 4 KiB weighs as much as a millisecond at 4 MiB. Timings drawn from the
    model give ``a`` and ``B`` back. A negative latency is clamped to 0 (the slope refitted
    through the origin); times that do not grow with the size cannot give a bandwidth (raised)."""
    pts = [(float(n), float(t)) for n, t in points]
    if p < 2:
        raise ValueError(f"fit {name}: a collective over p={p} rank moves nothing; p must be >= 2")
    if len({n for n, _ in pts}) < 2:
        raise ValueError(f"fit {name} at p={p}: needs times at two message sizes at least, got "
                         f"{len(pts)} point(s)")
    bad = [(n, t) for n, t in pts if not (n > 0 and t > 0)]
    if bad:
        raise ValueError(f"fit {name} at p={p}: sizes and times must be > 0, got {bad[:3]}")
    steps, share = factors(name, p)
    # t = A + S x, x = share * n, A = steps * a, S = 1 / B; weights 1 / t^2
    w = [1.0 / (t * t) for _, t in pts]
    x = [share * n for n, _ in pts]
    y = [t for _, t in pts]
    sw = sum(w)
    swx = sum(wi * xi for wi, xi in zip(w, x))
    swy = sum(wi * yi for wi, yi in zip(w, y))
    swxx = sum(wi * xi * xi for wi, xi in zip(w, x))
    swxy = sum(wi * xi * yi for wi, xi, yi in zip(w, x, y))
    det = sw * swxx - swx * swx
    slope = (sw * swxy - swx * swy) / det
    intercept = (swy - slope * swx) / sw
    if intercept < 0:
        intercept, slope = 0.0, swxy / swxx
    if not slope > 0:
        raise ValueError(f"fit {name} at p={p}: the measured times do not grow with the message "
                         f"size ({', '.join(f'{n:.0f} B: {t:.3g} s' for n, t in pts)}); measure "
                         "larger messages to fit a bandwidth")
    return Fit(name, p, intercept / steps, 1.0 / slope)
