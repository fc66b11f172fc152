"""Alpha-beta (latency-bandwidth) times of the collectives a plan uses, ring algorithms.

For ``p`` ranks, ``n`` bytes (the whole tensor: the input of an all-reduce, the output of an
all-gather, the input of a reduce-scatter), per-message latency ``a`` and bandwidth ``B`` per
direction (Thakur, Rabenseifner & Gropp 2005; NCCL's "bus bandwidth" convention):

* all-reduce ``2 (p-1) a + 2 (p-1)/p * n / B``;
* all-gather, reduce-scatter ``(p-1) a + (p-1)/p * n / B``;
* all-to-all ``(p-1) a + (p-1)/p * n / B`` (each rank keeps 1/p of its ``n`` bytes);
* point-to-point ``a + n / B``.

All are zero when ``p == 1`` (or ``n == 0`` for point-to-point).
"""
from __future__ import annotations

from .cluster import Link


def all_reduce(nbytes: float, p: int, link: Link) -> float:
    if p <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (p - 1) * link.latency + 2 * (p - 1) / p * nbytes / link.bandwidth


def all_gather(nbytes: float, p: int, link: Link) -> float:
    if p <= 1 or nbytes <= 0:
        return 0.0
    return (p - 1) * link.latency + (p - 1) / p * nbytes / link.bandwidth


reduce_scatter = all_gather
all_to_all = all_gather


def p2p(nbytes: float, link: Link) -> float:
    return 0.0 if nbytes <= 0 else link.latency + nbytes / link.bandwidth
