"""Asynchronous point-to-point transfers between pipeline ranks, with timeouts and names.

Sends and receives are posted where the schedule puts SEND_* / RECV_* and waited just before the
tensor is used (a receive) or at the end of the step (a send). Each transfer carries a tag made
of (direction, stage boundary, microbatch), so gloo matches them even when two ranks post them
in different orders (as interleaved and V schedules do). A wait that exceeds the timeout raises
`P2PError` naming this rank, the peer and the action.

Channels: a transfer goes over one of four process groups, chosen by (activation or gradient,
towards a higher or lower pipeline rank), so that on NCCL, which ignores tags and matches a
pair's transfers in posting order, each communicator carries one kind in one direction; the
order of those is the same on both sides for every pipesim schedule, and `check_p2p_order`
verifies it for any schedule before a NCCL run.

Shapes and dtypes: the receiver of a forward activation learns them once per stage boundary from
a small header the sender sends with its first activation; a backward gradient has the shape of
the forward output the receiver produced itself, so it needs no header.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
          torch.uint8, torch.bool)
_HEADER_LEN = 10   # dtype code, ndim, up to 8 dims
FWD, BWD = 0, 1


class P2PError(RuntimeError):
    """A transfer that failed or timed out, naming rank, peer and action."""


@dataclass
class Pending:
    work: Any
    tensor: torch.Tensor | None
    peer: int
    action: Any
    deferred: Any = None     # posts the receive at wait time (first activation of a boundary)


class P2P:
    """Tagged isend/irecv over a pipeline's four channel groups.

    ``groups``: one process group per channel (see `channel`); ``peers``: global rank of each
    pipeline rank. ``num_stages`` and ``num_microbatches`` size the
    tag space.
    """

    def __init__(self, *, rank: int, pp_rank: int, groups: tuple, peers: tuple[int, ...],
                 num_stages: int, num_microbatches: int, device: torch.device,
                 timeout: float) -> None:
        if len(groups) != 4:
            raise ValueError(f"P2P needs 4 channel groups, got {len(groups)}")
        self.rank, self.pp_rank, self.groups, self.peers = rank, pp_rank, groups, peers
        self.num_stages, self.m = num_stages, num_microbatches
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout)
        self.timeout_s = timeout
        self._specs: dict[int, tuple[torch.Size, torch.dtype]] = {}   # boundary -> activation spec
        self._header_sent: set[int] = set()
        self._sends: list[Pending] = []

    # -- tags and channels ------------------------------------------------------------------
    def _group(self, direction: int, src_pp: int, dst_pp: int):
        return self.groups[channel(direction, src_pp, dst_pp)]

    def _tag(self, direction: int, boundary: int, mb: int) -> int:
        return 1 + (direction * self.num_stages + boundary) * self.m + mb

    def _header_tag(self, boundary: int) -> int:
        return 1 + 2 * self.num_stages * self.m + boundary

    # -- sending ----------------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, peer_rank: int, direction: int, boundary: int, mb: int,
             action: Any) -> None:
        """Post an asynchronous send; keeps ``tensor`` alive until it completes."""
        peer = self.peers[peer_rank]
        group = self._group(direction, self.pp_rank, peer_rank)
        try:
            if direction == FWD and boundary not in self._header_sent:
                header = self._make_header(tensor)
                self._sends.append(Pending(dist.isend(header, peer, group=group,
                                                      tag=self._header_tag(boundary)),
                                           header, peer, action))
                self._header_sent.add(boundary)
            work = dist.isend(tensor.contiguous(), peer, group=group,
                              tag=self._tag(direction, boundary, mb))
        except Exception as exc:
            raise P2PError(f"rank {self.rank}: {action}: posting send to rank {peer} failed: "
                           f"{exc}") from exc
        self._sends.append(Pending(work, tensor, peer, action))
        self._reap()

    def _reap(self) -> None:
        """Drop completed sends, so their tensors can be freed."""
        if len(self._sends) > 4:
            self._sends = [p for p in self._sends if not p.work.is_completed()]

    def wait_sends(self) -> None:
        for p in self._sends:
            self._wait(p, "send to")
        self._sends.clear()

    # -- receiving --------------------------------------------------------------------------
    def recv_activation(self, peer_rank: int, boundary: int, mb: int, action: Any) -> Pending:
        """Post the receive of an activation. The first one of a boundary has no known shape
        yet: its header and data are then received when it is waited for, so that posting never
        blocks (a receive may be posted computations before its consumer)."""
        peer = self.peers[peer_rank]
        group = self._group(FWD, peer_rank, self.pp_rank)
        tag = self._tag(FWD, boundary, mb)
        pending = Pending(None, None, peer, action)
        if boundary in self._specs:
            self._post(pending, boundary, group, tag)
        else:
            pending.deferred = (boundary, group, tag)
        return pending

    def _post(self, p: Pending, boundary: int, group: Any, tag: int) -> None:
        spec = self._specs.get(boundary)
        if spec is None:
            header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
            self._wait(Pending(self._irecv(header, p.peer, group, self._header_tag(boundary),
                                           p.action), header, p.peer, p.action),
                       "activation header from")
            spec = self._specs[boundary] = self._read_header(header)
        p.tensor = torch.empty(spec[0], dtype=spec[1], device=self.device)
        p.work = self._irecv(p.tensor, p.peer, group, tag, p.action)

    def recv_gradient(self, peer_rank: int, boundary: int, mb: int, shape: torch.Size,
                      dtype: torch.dtype, action: Any) -> Pending:
        peer = self.peers[peer_rank]
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        group = self._group(BWD, peer_rank, self.pp_rank)
        return Pending(self._irecv(buf, peer, group, self._tag(BWD, boundary, mb), action), buf,
                       peer, action)

    def wait(self, pending: Pending) -> torch.Tensor:
        if pending.deferred is not None:
            boundary, group, tag = pending.deferred
            pending.deferred = None
            self._post(pending, boundary, group, tag)
        self._wait(pending, "receive from")
        return pending.tensor

    def _irecv(self, buf: torch.Tensor, peer: int, group: Any, tag: int, action: Any):
        try:
            return dist.irecv(buf, peer, group=group, tag=tag)
        except Exception as exc:
            raise P2PError(f"rank {self.rank}: {action}: posting receive from rank {peer} failed: "
                           f"{exc}") from exc

    def _wait(self, p: Pending, what: str) -> None:
        try:
            p.work.wait(self.timeout)
        except Exception as exc:
            text = str(exc)
            reason = (f"timed out after {self.timeout_s:g} s" if "imeout" in text or "imed out" in text
                      else f"failed ({text.strip().splitlines()[-1] if text.strip() else type(exc).__name__})")
            raise P2PError(f"rank {self.rank}: action {p.action}: {what} rank {p.peer} {reason}; "
                           f"the peer probably failed or is stuck") from exc

    # -- headers ----------------------------------------------------------------------------
    def _make_header(self, t: torch.Tensor) -> torch.Tensor:
        if t.dim() > _HEADER_LEN - 2:
            raise P2PError(f"rank {self.rank}: cannot send a {t.dim()}-d activation (max {_HEADER_LEN - 2})")
        if t.dtype not in DTYPES:
            raise P2PError(f"rank {self.rank}: cannot send dtype {t.dtype}")
        h = [DTYPES.index(t.dtype), t.dim(), *t.shape] + [0] * (_HEADER_LEN - 2 - t.dim())
        return torch.tensor(h, dtype=torch.int64, device=self.device)

    @staticmethod
    def _read_header(h: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
        vals = h.tolist()
        return torch.Size(vals[2: 2 + vals[1]]), DTYPES[vals[0]]


def channel(direction: int, src_pp: int, dst_pp: int) -> int:
    """Channel of a transfer: 2 * (activation 0 / gradient 1) + (1 if towards a lower rank)."""
    return 2 * direction + (1 if dst_pp < src_pp else 0)


def check_p2p_order(schedule) -> None:
    """Raise P2PError if, on some channel between two ranks, the sender's order of transfers
    differs from the receiver's (NCCL would pair the wrong tensors or deadlock)."""
    from pipesim.schedule.comms import peer_stage

    def key(a, rank):
        peer = schedule.stage_rank(peer_stage(a))
        direction = FWD if a.op.endswith("_F") else BWD
        src, dst = (rank, peer) if a.op.startswith("SEND") else (peer, rank)
        return (src, dst, channel(direction, src, dst)), (min(a.stage, peer_stage(a)), a.microbatch)

    sends: dict = {}
    recvs: dict = {}
    for rank in range(schedule.pp):
        for a in schedule.actions(rank):
            if a.op.startswith("SEND"):
                k, v = key(a, rank)
                sends.setdefault(k, []).append(v)
            elif a.op.startswith("RECV"):
                k, v = key(a, rank)
                recvs.setdefault(k, []).append(v)
    for k in sorted(set(sends) | set(recvs)):
        if sends.get(k, []) != recvs.get(k, []):
            src, dst, ch = k
            raise P2PError(f"schedule {schedule.name!r}: rank {src} sends channel {ch} transfers to "
                           f"rank {dst} in an order rank {dst} does not receive them in; NCCL "
                           "matches point-to-point transfers in order (use gloo, or change the "
                           "schedule)")
