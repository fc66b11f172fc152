"""Clock alignment: put every rank's timestamps on rank 0's clock.

At start-up each rank ``r > 0`` plays ``rounds`` ping-pongs with global rank 0 (NTP's idea):
it reads its clock (``t1``), sends, rank 0 answers with its own clock reading (``t0``), and it
reads its clock again on receipt (``t2``). If the two legs take equally long, rank 0 read ``t0``
when rank r's clock showed ``(t1 + t2) / 2``, so ``offset = t0 - (t1 + t2) / 2`` maps rank r's
times onto rank 0's; the error is at most half the round trip. The round with the shortest
round trip is kept (the least disturbed by scheduling noise). Rank 0 serves ranks one after
the other; every wait has a timeout naming the peer.

Only run when profiling: without ``--profile`` no rank exchanges anything here.
"""
from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist


class ClockAlignmentError(RuntimeError):
    """A round trip of the clock alignment failed or timed out (names rank and peer)."""


@dataclass(frozen=True)
class ClockOffset:
    """``offset``: seconds to add to this rank's clock to read rank 0's; ``rtt``: the round trip
    of the kept sample (twice the worst-case error of ``offset``)."""

    rank: int
    offset: float
    rtt: float


def _wait(work, timeout: float, rank: int, peer: int, what: str) -> None:
    try:
        work.wait(datetime.timedelta(seconds=timeout))
    except Exception as exc:
        raise ClockAlignmentError(f"rank {rank}: clock alignment: {what} rank {peer} failed or "
                                  f"timed out after {timeout:g} s: {exc}") from exc


def align_clocks(rank: int, world_size: int, *, rounds: int = 16, timeout: float = 60.0,
                 clock: Callable[[], float] = time.perf_counter, group=None,
                 device: torch.device | str = "cpu") -> ClockOffset:
    """Estimate this rank's offset to global rank 0 (collective: every rank must call it).

    ``device``: where the message lives (the backend's: CUDA for NCCL). Reading the received
    value (``float(buf[0])``) waits for it on either device, so clock readings are taken only
    once a message has really arrived.
    """
    if rounds < 1:
        raise ValueError(f"clock alignment needs at least one round, got {rounds}")
    if world_size == 1:
        return ClockOffset(rank, 0.0, 0.0)
    buf = torch.zeros(1, dtype=torch.float64, device=device)
    tag = 7_777
    if rank == 0:
        for peer in range(1, world_size):
            for _ in range(rounds):
                _wait(dist.irecv(buf, peer, group=group, tag=tag), timeout, rank, peer,
                      "ping from")
                float(buf[0])                   # arrived (synchronises a CUDA stream)
                buf.fill_(clock())
                _wait(dist.isend(buf, peer, group=group, tag=tag + 1), timeout, rank, peer,
                      "pong to")
        return ClockOffset(0, 0.0, 0.0)
    best: tuple[float, float] | None = None
    for _ in range(rounds):
        t1 = clock()
        buf.fill_(t1)
        _wait(dist.isend(buf, 0, group=group, tag=tag), timeout, rank, 0, "ping to")
        _wait(dist.irecv(buf, 0, group=group, tag=tag + 1), timeout, rank, 0, "pong from")
        t0 = float(buf[0])
        t2 = clock()
        rtt, offset = t2 - t1, t0 - (t1 + t2) / 2
        if best is None or rtt < best[0]:
            best = (rtt, offset)
    return ClockOffset(rank, best[1], best[0])
