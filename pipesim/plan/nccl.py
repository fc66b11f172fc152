"""NCCL's own model of a collective's time: its tuner, transcribed, picking the algorithm and
protocol it would (NVIDIA/nccl ``src/graph/tuning.cc``, commit 5067397, ``ncclTopoTuneModel``
and ``ncclTopoGetAlgoTime``).

NCCL times each (algorithm, protocol) as ``latency + nBytes / algorithm bandwidth`` and runs the
fastest; so does :func:`nccl_time`. Algorithms: the **ring**; the double binary **tree**
(all-reduce); **NVLS** (NVLink SHARP: the NVSwitch reduces, Hopper and Blackwell NVSwitch
systems, inside one NVLink domain); **NVLS tree** (NVLS inside each domain, a tree across them,
all-reduce); **PAT** (all-gather / reduce-scatter with one rank a domain). Protocols: LL, LL128,
Simple. CollNet (switch reduction over InfiniBand SHARP) is not modelled. Per (algorithm,
protocol), with ``B`` the ring's bus bandwidth (the link's: NVLink at NCCL's per-link figure, or
across domains the lesser of NVLink and the group's NICs), GB/s and microseconds as NCCL keeps
them:

* bus bandwidth: ring Simple ``B``; LL ``min(llMaxBw, B/2)``; LL128 ``min(.92 B, channels x
  perChMaxRingLL128Bw)``; tree (all-reduce) ``min(.92 B', channels x perChMaxTreeBw)`` (``B'``
  ``B``, on two domains NVLink's up to twice ``B``, as NCCL takes ``bwIntra`` there), LL that
  ``/ 3.8`` (at most ``llMaxBw``), LL128 that ``x 120/128`` (``7/9`` in one domain; at most
  ``channels x perChMaxTreeLL128Bw``); PAT ``.75 B``; NVLS ``nvlsEfficiency x G x (c - 1) / c``,
  ``x 2`` for an all-reduce (it pipelines the reduce and the broadcast), ``x (ppn - 1) / ppn``
  for all-gather / reduce-scatter, ``G`` the NVLS graph's bandwidth over its ``c`` channels
  (one a local GPU, at most 32, each at the fastest speed of NCCL's search array that fits the
  GPU's NVLink); NVLS tree the lesser of that and the NICs (twice the NICs on two domains) and
  ``c x perChMaxNVLSTreeBw``;
* algorithm bandwidth: the bus bandwidth ``x p / nsteps`` for the ring and NVLS (``nsteps``
  ``2 (p - 1)`` all-reduce, ``p - 1`` all-gather / reduce-scatter), ``x .5`` for the tree's
  all-reduce; PAT and NVLS all-gather / reduce-scatter as they are; the tree's all-reduce
  bandwidth times ``treeCorrectionFactor`` for the size;
* latency: ``baseLatencies[algorithm][protocol]``, then per algorithm the ring's ``(nsteps -
  nInter) x intra + nInter x inter`` (``nInter = 2 (nodes - 1)`` all-reduce, ``nodes - 1``
  else; intra at least 3 x 1 us of network overhead across domains with Simple; an all-reduce
  ring across domains at 1.4 x its latency once each rank's share of a channel reaches 64 B,
  "the plateau"), the tree's ``2 ((p / nodes - 1) intra + log2 nodes x inter)``, NVLS's
  ``intra (+ inter across domains)``, NVLS tree's ``intra + 2 log2 nodes x inter``, PAT's
  ``log2 nodes x inter / 3.5 + 2.8 p``; ``intra``, ``inter`` NCCL's NVLink and network figures
  for the algorithm and protocol (``hwLatencies``; ``inter`` the tree's where each domain holds
  one rank).

What NCCL reads off the machine and this model assumes: the CPU (``llMaxBws``' network rows are
the x86 Intel/ARM ones; network overhead 1 us), the net plugin's extra latency (0, InfiniBand's),
and the ring's channels (the count NCCL's per-channel ceilings multiply: assumed two a NVLink,
NCCL duplicating the rings its search finds on NVSwitch nodes, at most 32; the ceilings do not
bind at these counts except LL's ``llMaxBw``).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

ARCHS = ("ampere", "hopper", "blackwell")
PROTOCOLS = ("LL", "LL128", "Simple")
_AR, _AG, _RS = "all_reduce", "all_gather", "reduce_scatter"

# tuning.cc, ncclTunerConstantsDefaults: microseconds per (LL, LL128, Simple)
BASE_LATENCY = {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4), "nvls": (0.0, 0.0, 0.0),
                "nvls_tree": (0.0, 0.0, 0.0), "pat": (8.0, 8.0, 8.0)}
NVLINK_LATENCY = {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4), "nvls": (0.0, 0.0, 25.0),
                  "nvls_tree": (0.0, 0.0, 25.0), "pat": (0.0, 0.0, 4.0)}
NET_LATENCY = {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0), "nvls": (0.0, 0.0, 18.0),
               "nvls_tree": (0.0, 0.0, 20.9), "pat": (0.0, 0.0, 14.0)}
NET_OVERHEAD = 1.0          # getNetOverhead: x86 Intel (and ARM) 1 us; x3 with Simple
# GB/s, [arch][index2], index2 = 0 one node, 1 two nodes, 2 more
LL_MAX_BW_ONE_NODE = {"ampere": 87.7, "hopper": 141.0, "blackwell": 2 * 141.0}
LL_MAX_BW_NET = (39.0, 39.0, 20.4)          # llMaxBws row 0: multi-node, Intel / ARM CPUs
PER_CHANNEL_RING_LL128 = {"ampere": (20.0, 20.0, 20.0), "hopper": (36.7, 36.7, 36.7),
                          "blackwell": (40.0, 40.0, 40.0)}
PER_CHANNEL_TREE_LL128 = {"ampere": (20.0, 20.0, 20.0), "hopper": (36.7, 36.7, 29.0),
                          "blackwell": (55.6, 31.67, 20.0)}
PER_CHANNEL_TREE = {"ampere": (24.0, 23.6, 17.8), "hopper": (38.7, 41.4, 36.0),
                    "blackwell": (70.0, 42.8, 24.0)}
PER_CHANNEL_NVLS_TREE = {"hopper": (0.0, 57.7, 45.5), "blackwell": (0.0, 96.0, 80.0)}
NVLS_EFFICIENCY = {"hopper": 0.85, "blackwell": 0.74}
# search.cc: the NVLS graph's per-channel speeds, GB/s, fastest first
NVLS_SPEEDS = {"hopper": (60.0, 50.0, 40.0, 30.0, 24.0, 20.0, 15.0, 12.0, 11.0, 6.0, 3.0),
               "blackwell": (90.0, 80.0, 70.0, 60.0, 50.0, 45.0, 40.0, 30.0, 24.0, 20.0, 19.0,
                             18.0)}
NVLS_MAX_ARITY = 32         # device.h NCCL_MAX_NVLS_ARITY: NVLS channels, one per local GPU
# treeCorrectionFactor[protocol], sizes 64 B x 2^i
TREE_CORRECTION = {
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0,
           1.0, 1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9,
              .9, .9, 1.0, 1.0, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7,
               .8, .9, .9, .9),
}
MAX_RING_CHANNELS = 32      # assumed: two channels a NVLink, at most 32 (see the docstring)


@dataclass(frozen=True)
class Choice:
    """What NCCL's tuner picks for one collective: its time and how."""

    seconds: float
    algorithm: str
    protocol: str


def _log2i(n: int) -> int:
    return max(0, int(n).bit_length() - 1)


def nvls_graph_bandwidth(arch: str, local_bw: float, gpus: int) -> tuple[float, int]:
    """``(G, c)``: the NVLS graph's total bandwidth (GB/s) and channels over ``gpus`` local
    GPUs, each channel at the fastest speed of NCCL's array that ``c`` channels fit in the
    GPU's NVLink bus bandwidth ``local_bw`` (GB/s)."""
    c = min(NVLS_MAX_ARITY, gpus)
    for s in NVLS_SPEEDS[arch]:
        if c * s <= local_bw:
            return c * s, c
    return c * NVLS_SPEEDS[arch][-1], c


# A pure function of immutable values (a Choice is frozen) that a search asks for every
# collective of every plan it derives, a few hundred distinct ones among hundreds of thousands:
# computed once per distinct argument.
@lru_cache(maxsize=4096)
def nccl_time(name: str, nbytes: float, p: int, *, arch: str, bus: float, local_bus: float,
              nodes: int = 1, per_domain: int | None = None, links: int = 18,
              nvls: bool = False) -> Choice:
    """NCCL's fastest (algorithm, protocol) for collective ``name`` (all_reduce, all_gather,
    reduce_scatter) of ``nbytes`` (the whole tensor) over ``p`` ranks in ``nodes`` NVLink
    domains, ``per_domain`` of them (the fewest) in one; ``bus`` the ring's bus bandwidth and
    ``local_bus`` NVLink's (bytes/s), ``links`` NVLinks a GPU, ``nvls`` whether the NVSwitch
    reduces (NVLink SHARP)."""
    if arch not in ARCHS:
        raise ValueError(f"NCCL tuner: arch {arch!r} is not one of {', '.join(ARCHS)}")
    if name not in (_AR, _AG, _RS):
        raise ValueError(f"NCCL tuner: {name!r} has no tuner model (all_reduce, all_gather, "
                         "reduce_scatter)")
    nodes = max(1, min(nodes, p))
    ppn = per_domain if per_domain is not None else max(1, p // nodes)
    B, L = bus / 1e9, local_bus / 1e9                   # GB/s, as NCCL keeps them
    idx2 = min(nodes, 3) - 1
    ll_max = LL_MAX_BW_ONE_NODE[arch] if nodes == 1 else LL_MAX_BW_NET[idx2]
    channels = min(MAX_RING_CHANNELS, 2 * links)
    nsteps = 2 * (p - 1) if name == _AR else p - 1
    n_inter = 0 if nodes == 1 else (2 * (nodes - 1) if name == _AR else nodes - 1)
    logsize = _log2i(int(nbytes) >> 6) if nbytes >= 64 else -1
    best: Choice | None = None

    def consider(algo: str, proto: str, bus_bw: float, latency_us: float) -> None:
        nonlocal best
        if bus_bw <= 0:
            return
        if algo in ("ring", "nvls", "nvls_tree") and not (algo == "nvls" and name != _AR):
            alg_bw = bus_bw * p / nsteps
        elif algo == "tree":
            alg_bw = bus_bw * 0.5
            if 0 <= logsize < 23:
                alg_bw *= TREE_CORRECTION[proto][logsize]
        else:                                           # PAT, NVLS all-gather/reduce-scatter
            alg_bw = bus_bw
        t = latency_us * 1e-6 + nbytes / (alg_bw * 1e9)
        if best is None or t < best.seconds:
            best = Choice(t, algo, proto)

    for i, proto in enumerate(PROTOCOLS):
        # -- ring ----------------------------------------------------------------------------
        if proto == "Simple":
            bw = B
        elif proto == "LL":
            bw = min(ll_max, B * 0.5)
        else:
            bw = min(B * 0.92, channels * PER_CHANNEL_RING_LL128[arch][idx2])
        intra = NVLINK_LATENCY["ring"][i]
        inter = NET_LATENCY["tree" if p == nodes else "ring"][i]     # ppn = p / nodes = 1
        if nodes > 1:
            intra = max(intra, NET_OVERHEAD * (3 if proto == "Simple" else 1))
        lat = BASE_LATENCY["ring"][i] + (nsteps - n_inter) * intra + n_inter * inter
        if (proto == "Simple" and nodes > 1 and name == _AR
                and nbytes / (channels * p) >= 64):
            lat *= 1.4                                  # the ring's plateau
        consider("ring", proto, bw, lat)
        # -- tree (all-reduce) -----------------------------------------------------------------
        if name == _AR:
            # NCCL takes the intra-domain bandwidth on two domains (bwIntra): the tree's
            # network traffic is half the ring's there, so up to twice the NICs'
            tree_bus = min(L, 2 * B) if nodes <= 2 else B
            tb = min(tree_bus * 0.92, channels * PER_CHANNEL_TREE[arch][idx2])
            if proto == "LL":
                tb = min(tb / 3.8, ll_max)
            elif proto == "LL128":
                tb = min(tb * (7.0 / 9.0 if nodes == 1 else 120.0 / 128.0),
                         channels * PER_CHANNEL_TREE_LL128[arch][idx2])
            t_intra = NVLINK_LATENCY["tree"][i]
            t_inter = NET_LATENCY["tree"][i]
            lat = BASE_LATENCY["tree"][i] + 2 * ((p // nodes - 1) * t_intra
                                                 + _log2i(nodes) * t_inter)
            consider("tree", proto, tb, lat)
    # -- PAT: all-gather / reduce-scatter with one rank a domain, Simple -----------------------
    if name != _AR and nodes > 1 and nodes == p:
        lat = (BASE_LATENCY["pat"][2] + _log2i(nodes) * NET_LATENCY["pat"][2] / 3.5 + 2.8 * p)
        consider("pat", "Simple", B * 0.75, lat)
    # -- NVLS: inside one domain; NVLS tree across domains (all-reduce) --------------------------
    if nvls and arch in NVLS_EFFICIENCY:
        G, c = nvls_graph_bandwidth(arch, L, ppn)
        if c >= 2:
            intra_bw = G * NVLS_EFFICIENCY[arch] * (c - 1) / c
            intra_bw *= 2.0 if name == _AR else (ppn - 1) / ppn
            if nodes == 1:
                consider("nvls", "Simple", intra_bw, NVLINK_LATENCY["nvls"][2])
            elif name == _AR:
                inter_bw = B * (2 if nodes <= 2 else 1)
                bw = min(intra_bw, inter_bw, c * PER_CHANNEL_NVLS_TREE[arch][idx2])
                lat = (BASE_LATENCY["nvls_tree"][2] + NVLINK_LATENCY["nvls_tree"][2]
                       + 2 * _log2i(nodes) * NET_LATENCY["nvls_tree"][2])
                consider("nvls_tree", "Simple", bw, lat)
    assert best is not None
    return best


def ring_bus_bandwidth(local_bus: float, nic_bus: float, per_domain: int) -> float:
    """A ring across NVLink domains, rail-aligned: each of the group's ``per_domain`` ranks in a
    domain leaves it on its own NIC(s) (one channel each), so the ring's bus bandwidth is the
    lesser of NVLink's and ``per_domain`` GPUs' network bandwidth (bytes/s)."""
    return min(local_bus, per_domain * nic_bus)
