"""Asynchronous point-to-point transfers between pipeline ranks, with timeouts and names.

Sends and receives are posted where the schedule puts SEND_* / RECV_* and waited just before the
tensor is used (a receive) or at the end of the step (a send). A wait that exceeds the timeout
raises `P2PError` naming this rank, the peer and the action.

Channels: a transfer goes over the process group of its channel ``(direction, src, dst)``
(activation or gradient, from pipeline rank ``src`` to ``dst``): a 2-rank group per kind and
per ordered pair of ring neighbours (`pipeexec.topology`). On NCCL each group is one
communicator with one stream per rank, so every stream carries one kind, one way, between two
ranks: a FIFO whose sender and receiver post in the same order (`check_p2p_order`), which cannot
deadlock (`pipesim.schedule.channels`, run over every builder by the tests).

Matching: NCCL ignores tags and matches a channel's transfers in the order they are posted;
gloo matches by tag. Tags (direction, stage boundary, microbatch) are kept for gloo, but the
posting order is made right for NCCL too: on each channel, receives are posted in the
schedule's order, never one before an earlier one that is still deferred (below).
``nccl_matching=True`` forces every tag to 0, so gloo matches as NCCL does: a CPU run then shows
what a NCCL run would compute. `record_posting` logs what is really posted, per channel.

Waiting: on gloo (CPU) a wait blocks the host, with the timeout. On CUDA (NCCL) a wait is a
stream wait: ``work.wait()`` makes the current (compute) stream wait for the transfer and the
host goes on (torch's ``work.wait(timeout)`` would instead poll the host in 1 ms sleeps from
torch 2.6, and ignore the timeout before). The timeout is then enforced where the host syncs
anyway, at the end of each step (`wait_sends`): every transfer of the step must complete within
``timeout``, else `P2PError` names the rank, the peer and the first action still incomplete.
If the host itself is stuck, the channel groups' own timeout and NCCL's watchdog abort the
process (flight recorder: README, GPUs).

Shapes and dtypes: the receiver of a forward activation learns them once per stage boundary from
a small header the sender sends on the same channel right before its first activation; a
backward gradient has the shape of the forward output the receiver produced itself, so it needs
no header. A receive whose shape is not known yet is deferred: it is posted (header, then data)
when it is waited for. Every later receive on its channel is deferred behind it, in order, so a
microbatch's data can never land in another microbatch's buffer.
"""
from __future__ import annotations

import datetime
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipesim.schedule.channels import (ChannelError, check_channels, group_collectives, one_way_pairs,
                                       transfer_of)

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
          torch.uint8, torch.bool)
_HEADER_LEN = 10   # dtype code, ndim, up to 8 dims
FWD, BWD = 0, 1
ChannelKey = tuple[int, int, int]   # (FWD or BWD, source pipeline rank, destination pipeline rank)


class P2PError(RuntimeError):
    """A transfer that failed or timed out, naming rank, peer and action."""


@dataclass(eq=False)        # identity: a deferred receive is found in its queue by `is`
class Pending:
    work: Any
    tensor: torch.Tensor | None
    peer: int
    action: Any
    # a deferred receive: (channel, boundary, group, tag); posted when waited for
    deferred: Any = None
    mb: int = -1


class P2P:
    """Tagged isend/irecv over a pipeline's channel groups.

    ``groups``: the process group of every channel this rank is an end of, keyed
    ``(direction, src pipeline rank, dst pipeline rank)``; ``peers``: global rank of each
    pipeline rank. ``num_stages`` and ``num_microbatches`` size the tag space.
    """

    def __init__(self, *, rank: int, pp_rank: int, groups: Mapping[ChannelKey, Any],
                 peers: tuple[int, ...], num_stages: int, num_microbatches: int,
                 device: torch.device, timeout: float, nccl_matching: bool = False) -> None:
        self.rank, self.pp_rank, self.groups, self.peers = rank, pp_rank, dict(groups), peers
        self.num_stages, self.m = num_stages, num_microbatches
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout)
        self.timeout_s = timeout
        self.nccl_matching = nccl_matching
        self._specs: dict[int, tuple[torch.Size, torch.dtype]] = {}   # boundary -> activation spec
        self._header_sent: set[int] = set()
        self._sends: list[Pending] = []
        self._deferred: dict[ChannelKey, deque[Pending]] = {}   # per channel, in posting order
        self._log: dict[ChannelKey, list[tuple]] | None = None
        # CUDA: stream waits; the host checks the step's transfers at its end (see above)
        self.stream_waits = device.type == "cuda"
        self._stream_waited: list[tuple[Pending, str]] = []

    def activation_specs(self) -> dict[int, tuple[torch.Size, torch.dtype]]:
        """(shape, dtype) of the activation received at each stage boundary seen so far."""
        return dict(self._specs)

    def record_posting(self) -> dict[ChannelKey, list[tuple]]:
        """Start logging every transfer as it is really posted; returns the log: per channel,
        ``(what, direction, boundary, microbatch)`` in posting order, ``what`` being "header" or
        "data" (the microbatch of a header is that of the data it precedes). A sender's list of
        a channel must equal its receiver's list of the same channel (NCCL's matching)."""
        self._log = {}
        return self._log

    # -- tags and channels ------------------------------------------------------------------
    def _group(self, key: ChannelKey, action: Any):
        try:
            return self.groups[key]
        except KeyError:
            kind = "activation" if key[0] == FWD else "gradient"
            raise P2PError(f"rank {self.rank}: {action}: no {kind} channel from pipeline rank "
                           f"{key[1]} to {key[2]} (channels connect ring neighbours only: "
                           f"{sorted(self.groups)})") from None

    def _tag(self, direction: int, boundary: int, mb: int) -> int:
        if self.nccl_matching:
            return 0
        return 1 + (direction * self.num_stages + boundary) * self.m + mb

    def _header_tag(self, boundary: int) -> int:
        if self.nccl_matching:
            return 0
        return 1 + 2 * self.num_stages * self.m + boundary

    def _note(self, key: ChannelKey, what: str, boundary: int, mb: int) -> None:
        if self._log is not None:
            self._log.setdefault(key, []).append((what, key[0], boundary, mb))

    # -- sending ----------------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, peer_rank: int, direction: int, boundary: int, mb: int,
             action: Any) -> None:
        """Post an asynchronous send; keeps ``tensor`` alive until it completes."""
        peer = self.peers[peer_rank]
        key = (direction, self.pp_rank, peer_rank)
        group = self._group(key, action)
        try:
            if direction == FWD and boundary not in self._header_sent:
                header = self._make_header(tensor)
                self._note(key, "header", boundary, mb)
                self._sends.append(Pending(dist.isend(header, peer, group=group,
                                                      tag=self._header_tag(boundary)),
                                           header, peer, action))
                self._header_sent.add(boundary)
            self._note(key, "data", boundary, mb)
            work = dist.isend(tensor.contiguous(), peer, group=group,
                              tag=self._tag(direction, boundary, mb))
        except P2PError:
            raise
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
        """End of a step: every send (and, on CUDA, every stream-waited receive) completes."""
        if self.stream_waits:
            self._host_wait([(p, "send to") for p in self._sends] + self._stream_waited)
            self._stream_waited.clear()
        else:
            for p in self._sends:
                self._wait(p, "send to")
        self._sends.clear()

    # -- receiving --------------------------------------------------------------------------
    def recv_activation(self, peer_rank: int, boundary: int, mb: int, action: Any) -> Pending:
        """Post the receive of an activation. The first one of a boundary has no known shape
        yet: it is deferred to its wait (so that posting never blocks: a receive may be posted
        computations before its consumer), and so is every later receive of its channel."""
        key = (FWD, peer_rank, self.pp_rank)
        pending = Pending(None, None, self.peers[peer_rank], action, mb=mb)
        pending.deferred = (key, boundary, self._group(key, action), self._tag(FWD, boundary, mb))
        if boundary in self._specs and not self._deferred.get(key):
            self._post(pending)
        else:
            self._deferred.setdefault(key, deque()).append(pending)
        return pending

    def recv_gradient(self, peer_rank: int, boundary: int, mb: int, shape: torch.Size,
                      dtype: torch.dtype, action: Any) -> Pending:
        key = (BWD, peer_rank, self.pp_rank)
        pending = Pending(None, torch.empty(shape, dtype=dtype, device=self.device),
                          self.peers[peer_rank], action, mb=mb)
        pending.deferred = (key, boundary, self._group(key, action), self._tag(BWD, boundary, mb))
        if self._deferred.get(key):
            self._deferred[key].append(pending)
        else:
            self._post(pending)
        return pending

    def _post(self, p: Pending) -> None:
        """Post receive ``p`` now (its channel has nothing deferred before it)."""
        key, boundary, group, tag = p.deferred
        p.deferred = None
        if p.tensor is None:
            spec = self._specs.get(boundary)
            if spec is None:
                header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
                self._note(key, "header", boundary, p.mb)
                hp = Pending(self._irecv(header, p.peer, group, self._header_tag(boundary),
                                         p.action), header, p.peer, p.action)
                if self.stream_waits:      # the host reads it: wait on the host, with timeout
                    self._host_wait([(hp, "activation header from")])
                    hp.work.wait()
                else:
                    self._wait(hp, "activation header from")
                spec = self._specs[boundary] = self._read_header(header)
            p.tensor = torch.empty(spec[0], dtype=spec[1], device=self.device)
        self._note(key, "data", boundary, p.mb)
        p.work = self._irecv(p.tensor, p.peer, group, tag, p.action)

    def wait(self, pending: Pending) -> torch.Tensor:
        if pending.deferred is not None:
            queue = self._deferred.get(pending.deferred[0])
            if not queue or not any(q is pending for q in queue):
                raise P2PError(f"rank {self.rank}: {pending.action}: waited for a receive that "
                               "was never posted")
            while True:          # post this channel's deferred receives in order, up to this one
                p = queue.popleft()
                self._post(p)
                if p is pending:
                    break
        if self.stream_waits:
            pending.work.wait()            # the compute stream waits; the host goes on
            self._stream_waited.append((pending, "receive from"))
        else:
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

    def _host_wait(self, items: list[tuple[Pending, str]]) -> None:
        """Poll until every transfer has completed; past the timeout raise P2PError naming the
        first incomplete one in ``items``' order (sends, then receives, each as posted). Sleeps 0.2 ms between polls, and only while
        something is still in flight."""
        deadline = time.monotonic() + self.timeout_s
        for p, what in items:
            while True:
                try:
                    if p.work.is_completed():
                        break
                except Exception as exc:
                    raise P2PError(f"rank {self.rank}: action {p.action}: {what} rank {p.peer} "
                                   f"failed ({exc})") from exc
                if time.monotonic() > deadline:
                    raise P2PError(f"rank {self.rank}: action {p.action}: {what} rank {p.peer} "
                                   f"still incomplete after {self.timeout_s:g} s; the peer "
                                   "probably failed or is stuck")
                time.sleep(0.0002)

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


def check_channels_exist(schedule, pp_rank: int, channels) -> None:
    """Raise P2PError naming the first action of ``pp_rank`` whose transfer has no channel
    among ``channels`` (a hand-made placement sending between ranks that are not ring
    neighbours), before any step starts."""
    keys = set(channels)
    for a in schedule.actions(pp_rank):
        if a.op in ("SEND_F", "RECV_F", "SEND_B", "RECV_B"):
            t = transfer_of(schedule, pp_rank, a)
            if (FWD if t.kind == "F" else BWD, t.src, t.dst) not in keys:
                raise P2PError(f"schedule {schedule.name!r}: pipeline rank {pp_rank}: {a} needs a "
                               f"channel from rank {t.src} to {t.dst}, and pipeexec connects "
                               "ring neighbours only (placements with stages on adjacent ranks)")


def check_p2p_order(schedule, *, collectives: bool = False) -> None:
    """Raise P2PError if some channel's transfers would match the wrong tensor or deadlock
    under NCCL's rules with pipeexec's channel layout (`pipesim.schedule.channels`, with the
    runtime's deferral of a boundary's first activation); run before every NCCL run.
    ``collectives``: the computations run collectives too (tp's, ZeRO-2/3's), each group on a
    communicator of its own (`pipeexec.topology`)."""
    try:
        check_channels(schedule, one_way_pairs, defer_first_activation=True,
                       collective_of=group_collectives if collectives else None)
    except ChannelError as exc:
        raise P2PError(f"{exc} (use gloo, or change the schedule)") from exc
