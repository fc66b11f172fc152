"""`lower(schedule) -> Program`: a schedule's action lists as the rows every interpreter reads.

What an action waits for, what it sends and on which link is a property of the schedule, not of
the interpreter; before this module the SimPy engine, the dataflow engine, the deadlock pass,
the channel check and the memory model each worked it out again (message arithmetic on 14
lines, overlaps split in two places). Lowering does it once, cached on the (immutable)
schedule:

* rows, rank by rank, in the rank's order, every ``OVERLAP_F_B`` split into its parts (here and
  nowhere else): ``(code, stage, microbatch, wait, wait_row, gate, gate_row, message, link,
  boundary, overlap)``, see :class:`Row`; a row's global index is its place in the rank-major
  concatenation (the trace's row order). A sharding action (``UNSHARD``, ``RESHARD``,
  ``REDUCE_GRAD``, :mod:`pipesim.schedule.sharding`) is a row of its own that waits for and
  sends nothing on the pipeline (its collective is over the data-parallel group);
* messages, numbered by :func:`message`: ``(direction * num_stages + receiving stage) *
  microbatches + microbatch``, direction 0 for an activation, 1 for a gradient;
* per message its :class:`Transfer`: kind, sending and receiving rank, the boundary (lower)
  stage, the microbatch, and the rows that produce, send, post and consume it.

Two row sets: ``in_turn`` (an overlap's parts run one after the other, each waiting for its own
input: pipeexec, torch, the channel check) and ``together`` (the parts start together once both
inputs are there: the forward part's ``gate`` is the backward part's input, which then waits for
nothing more; the deadlock pass, and the simulator when ``CostModel.overlaps_parts``). They are
the same rows when the schedule has no overlaps.
"""
from __future__ import annotations

import gc
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, NamedTuple, TypeVar

from .action import Action
from .op import (CODE_B, CODE_F, CODE_I, CODE_RECV_B, CODE_RECV_F, CODE_SEND_B, CODE_SEND_F,
                 CODE_W, FIRST_COMM_CODE, FIRST_SHARD_CODE, Op)

if TYPE_CHECKING:
    from .schedule import Schedule

T = TypeVar("T")
FORWARD, BACKWARD = 0, 1          # a message's direction: an activation, a gradient


def message(direction: int, receiving_stage: int, microbatch: int, num_stages: int,
            microbatches: int) -> int:
    """The number of the tensor sent to ``receiving_stage`` (the one place this is computed)."""
    return (direction * num_stages + receiving_stage) * microbatches + microbatch


def message_parts(msg: int, num_stages: int, microbatches: int) -> tuple[int, int, int]:
    """(direction, receiving stage, microbatch) of a message number."""
    key, mb = divmod(msg, microbatches)
    direction, stage = divmod(key, num_stages)
    return direction, stage, mb


class Row(NamedTuple):
    """One basic action of one rank, with what it waits for and what it sends (-1: none). The
    program holds its rows as plain tuples in this layout (unpacked in the hot loops; half the
    cost of making them); ``Row(*row)`` names the fields.

    ``wait``: the message a computation waits for, received by the RECV at global row
    ``wait_row`` posted earlier on the rank (an input made on the rank itself, or a receive
    posted later, waits for nothing); ``gate``/``gate_row``: the same for the backward part of
    an overlap, on its forward part's row (``together`` rows only); ``message``: the message a
    SEND_* sends or a RECV_* posts; ``link``: a SEND's directed link ``src * pp + dst``;
    ``boundary``: the lower stage of the boundary a SEND/RECV crosses (its bytes are that
    stage's ``p2p_bytes``); ``overlap``: the index of the overlap this row is a part of."""

    code: int
    stage: int
    microbatch: int
    wait: int
    wait_row: int
    gate: int
    gate_row: int
    message: int
    link: int
    boundary: int
    overlap: int

    @property
    def op(self) -> Op:
        return Op.of_code(self.code)

    @property
    def action(self) -> Action:
        return Action(Op.of_code(self.code).value, self.stage, self.microbatch)


class Transfer(NamedTuple):
    """A message: ``direction`` (FORWARD/BACKWARD) from rank ``src`` to ``dst`` across the
    boundary after stage ``boundary``, for ``microbatch``; the global rows that make it
    (``producer``: the F, or the B/I), send it, post its receive, and consume it (-1: none)."""

    direction: int
    src: int
    dst: int
    boundary: int
    microbatch: int
    producer: int
    send: int
    recv: int
    consumer: int


class Program:
    """A schedule lowered (see the module docstring). Read-only by convention; shared by every
    interpreter of the same schedule, made once per schedule."""

    __slots__ = ("pp", "num_stages", "num_microbatches", "in_turn", "together", "first_row",
                 "_transfers", "_links", "overlaps", "num_messages", "_steps", "_compute_rows",
                 "_sent_forward", "_derived", "num_rows", "sharded")

    def __init__(self, pp, num_stages, num_microbatches, in_turn, together, links,
                 overlaps) -> None:
        self.pp, self.num_stages, self.num_microbatches = pp, num_stages, num_microbatches
        self.in_turn: tuple[tuple[Row, ...], ...] = in_turn
        self.together: tuple[tuple[Row, ...], ...] = together
        first, row = [], 0
        for rows in in_turn:
            first.append(row)
            row += len(rows)
        self.first_row = tuple(first)             # global index of each rank's first row
        self.num_rows = row
        self._links = links                       # what `transfers` is made from, on use
        self._transfers: dict[int, Transfer] | None = None
        self.overlaps: tuple[tuple[int, int], ...] = overlaps   # (forward row, backward row)
        self.num_messages = 2 * num_stages * num_microbatches
        # whether it has sharding actions (ZeRO's): an interpreter's lane is used at all
        self.sharded = any(r[0] >= FIRST_SHARD_CODE for rows in in_turn for r in rows)
        self._steps: dict = {}
        self._compute_rows = None
        self._sent_forward: bytes | None = None
        self._derived: dict = {}

    def derived(self, make: Callable[..., T], *args: Hashable) -> T:
        """``make(self, *args)``, made on the first call and kept with the program: what an
        interpreter derives from the rows alone (the simulator's index arrays, its order of
        steps) then costs one lookup a run, as the program itself is made once a schedule.
        ``make`` must be a pure function of the program and ``args``, returning an immutable
        value (tuples, read-only arrays): every caller of the same program shares it."""
        key = (make, args)
        value = self._derived.get(key)
        if value is None:
            value = self._derived[key] = make(self, *args)
        return value

    def sent_forward(self) -> bytes:
        """A flag per ``stage * microbatches + microbatch``: 1 where that F's output is sent to
        another rank (the producers of the forward transfers; what the memory model holds as a
        send buffer)."""
        if self._sent_forward is None:
            n, m = self.num_stages, self.num_microbatches
            flags = bytearray(n * m)
            _placement, sends, recvs = self._links[:3]
            # a forward message to stage s >= 1 carries boundary s - 1's output: its number
            # (`message`) less m is that flag's index (no Transfer made for it)
            first, end = message(FORWARD, 1, 0, n, m), message(FORWARD, n - 1, m - 1, n, m)
            for msg in sends.keys() | recvs.keys():
                if first <= msg <= end:
                    flags[msg - m] = 1
            self._sent_forward = bytes(flags)
        return self._sent_forward

    def compute_rows(self) -> list[list[int]]:
        """Each rank's compute rows (global indices, ascending)."""
        if self._compute_rows is None:
            self._compute_rows = [[row for row, r in enumerate(rows, self.first_row[rank])
                                   if r[0] < FIRST_COMM_CODE]
                                  for rank, rows in enumerate(self.in_turn)]
        return self._compute_rows

    def steps(self, together: bool = False, posts: bool = False) -> tuple[tuple, ...]:
        """The rows as a rank walks them (:func:`pipesim.sim.dataflow.walk`): per rank, steps
        ``(rank, row, code, stage, wait, wait_row, gate, gate_row, sends)``, a computation with the
        SEND rows right after it (``sends``: ``(row, message, link, boundary)`` each), a lone
        group of SENDs (code -1), or a RECV (``wait``: its message). A RECV whose consumer waits
        for it is left out unless ``posts`` (the consumer sets its span; rendezvous needs every
        posting): a third of a schedule's rows the walk need not visit."""
        key = (together, posts)
        if key not in self._steps:
            collecting = gc.isenabled()
            gc.disable()             # many small tuples, no cycles (as in lowering)
            try:
                self._steps[key] = tuple(self._rank_steps(rank, rows, first, posts)
                                         for rank, (rows, first)
                                         in enumerate(zip(self.rows(together), self.first_row)))
            finally:
                if collecting:
                    gc.enable()
        return self._steps[key]

    def _rank_steps(self, rank: int, rows: tuple[tuple, ...], first: int, posts: bool) -> tuple:
        waited = {r[4] for r in rows if r[4] >= 0} | {r[6] for r in rows if r[6] >= 0}
        out: list = []
        pending: list = []                  # the sends after the last step, not yet attached
        for row, (code, stage, _mb, wait, wait_row, gate, gate_row, msg, link, boundary,
                  _ov) in enumerate(rows, first):
            if code == CODE_SEND_F or code == CODE_SEND_B:
                pending.append((row, msg, link, boundary))
                continue
            if pending:
                _attach(out, pending, rank)
                pending = []
            if code == CODE_RECV_F or code == CODE_RECV_B:
                if posts or row not in waited:
                    out.append((rank, row, code, stage, msg, -1, -1, -1, ()))
            elif code >= FIRST_SHARD_CODE:
                out.append((rank, row, code, stage, -1, -1, -1, -1, ()))
            else:
                out.append((rank, row, code, stage, wait, wait_row, gate, gate_row, ()))
        if pending:
            _attach(out, pending, rank)
        return tuple(out)

    @property
    def transfers(self) -> dict[int, Transfer]:
        """Per message number its :class:`Transfer` (made on first use: the simulator does
        not need them)."""
        if self._transfers is None:
            self._transfers = _transfers(self._links[0], self.num_stages,
                                         self.num_microbatches, *self._links[1:])
        return self._transfers

    def rows(self, together: bool = False) -> tuple[tuple[Row, ...], ...]:
        return self.together if together else self.in_turn

    def rank_of_row(self, row: int) -> tuple[int, int]:
        """(rank, index in that rank's rows) of a global row."""
        for rank in range(self.pp - 1, -1, -1):
            if row >= self.first_row[rank]:
                return rank, row - self.first_row[rank]
        raise IndexError(row)

    def actions(self, rank: int) -> list[Action]:
        """The rank's basic actions, overlaps split (what the rows say, as Actions)."""
        return [Row(*r).action for r in self.in_turn[rank]]


def _attach(out: list, sends: list, rank: int) -> None:
    """Sends to the step before them when it is a computation (or sends), else a lone group."""
    if out and out[-1][2] != CODE_RECV_F and out[-1][2] != CODE_RECV_B and \
            out[-1][2] < FIRST_SHARD_CODE:
        last = out[-1]
        out[-1] = last[:8] + (last[8] + tuple(sends),)
    else:
        out.append((rank, -1, -1, -1, -1, -1, -1, -1, tuple(sends)))


def lower(schedule: "Schedule") -> Program:
    """The schedule's Program, made on first call and kept on the schedule."""
    program = schedule._program
    if program is None:
        program = _lower(schedule)
        object.__setattr__(schedule, "_program", program)
    return program


def _lower(schedule: "Schedule") -> Program:
    pp, n, m = schedule.pp, schedule.num_stages, schedule.num_microbatches
    nm = n * m                       # message(d, s, mb) = d * nm + s * m + mb, inlined below
    placement = schedule.placement
    code_of = {op.value: op.code for op in Op}
    overlap_op = Op.OVERLAP_F_B.value
    in_turn: list[tuple[Row, ...]] = []
    together: list[tuple[Row, ...]] | None = [] if schedule.has_overlaps else None
    overlaps: list[tuple[int, int]] = []
    sends: dict[int, int] = {}
    recvs: dict[int, int] = {}
    consumers: dict[int, int] = {}
    producers: dict[int, int] = {}    # message number of the tensor a compute row makes -> row
    row = 0
    collecting = gc.isenabled()
    gc.disable()                     # ~400k small tuples: no cycles, and the collector's passes
    try:                             # over the growing lists would cost more than the rows
        for rank in range(pp):
            posted: dict[int, int] = {}               # message -> row of its RECV, so far
            out: list[tuple] = []
            append = out.append
            base = rank * pp
            first = row
            acts = schedule.actions(rank)
            ovs = None                                # the overlap each basic action is part of
            if together is not None:
                flat, ovs = [], []
                for a in acts:
                    if a.op == overlap_op:
                        at = first + len(flat)
                        overlaps.append((at, at + 1))
                        flat.extend(a.parts)
                        ovs += [len(overlaps) - 1] * 2
                    else:
                        flat.append(a)
                        ovs.append(-1)
                acts = flat
            for i, (op, stage, mb) in enumerate(acts):
                overlap = -1 if ovs is None else ovs[i]
                code = code_of[op]
                if code < FIRST_COMM_CODE:
                    if code == CODE_W:
                        append((code, stage, mb, -1, -1, -1, -1, -1, -1, -1, overlap))
                    else:
                        key = stage * m + mb if code == CODE_F else nm + stage * m + mb
                        producers[key] = row
                        wait_row = posted.get(key, -1)
                        if wait_row >= 0:
                            consumers[key] = row
                            append((code, stage, mb, key, wait_row, -1, -1, -1, -1, -1, overlap))
                        else:
                            append((code, stage, mb, -1, -1, -1, -1, -1, -1, -1, overlap))
                elif code == CODE_SEND_F:
                    msg = (stage + 1) * m + mb
                    sends[msg] = row
                    append((code, stage, mb, -1, -1, -1, -1, msg, base + placement[stage + 1],
                            stage, overlap))
                elif code == CODE_SEND_B:
                    msg = nm + (stage - 1) * m + mb
                    sends[msg] = row
                    append((code, stage, mb, -1, -1, -1, -1, msg, base + placement[stage - 1],
                            stage - 1, overlap))
                elif code >= FIRST_SHARD_CODE:          # UNSHARD, RESHARD, REDUCE_GRAD
                    append((code, stage, mb, -1, -1, -1, -1, -1, -1, -1, -1))
                else:                                   # RECV_F, RECV_B
                    if code == CODE_RECV_F:
                        msg, boundary = stage * m + mb, stage - 1
                    else:
                        msg, boundary = nm + stage * m + mb, stage
                    posted[msg] = recvs[msg] = row
                    append((code, stage, mb, -1, -1, -1, -1, msg, -1, boundary, overlap))
                row += 1
            in_turn.append(tuple(out))
            if together is not None:
                gated = list(out)
                for fwd_row, bwd_row in overlaps:
                    if first <= fwd_row < row:
                        fwd, bwd = out[fwd_row - first], out[bwd_row - first]
                        gated[fwd_row - first] = fwd[:5] + (bwd[3], bwd[4]) + fwd[7:]  # its gate
                        gated[bwd_row - first] = bwd[:3] + (-1, -1) + bwd[5:]  # waited there
                together.append(tuple(gated))
    finally:
        if collecting:
            gc.enable()
    in_turn_t = tuple(in_turn)
    return Program(pp, n, m, in_turn_t, tuple(together) if together is not None else in_turn_t,
                   (placement, sends, recvs, consumers, producers), tuple(overlaps))


def _transfers(pp_placement, n: int, m: int, sends, recvs, consumers, producers
               ) -> dict[int, Transfer]:
    placement = pp_placement
    transfers: dict[int, Transfer] = {}
    for msg in sends.keys() | recvs.keys():
        direction, stage, mb = message_parts(msg, n, m)
        sender = stage - 1 if direction == FORWARD else stage + 1
        if not 0 <= sender < n:
            continue                                         # refused by validate()
        transfers[msg] = Transfer(direction, placement[sender], placement[stage],
                                  min(stage, sender), mb,
                                  producers.get(message(direction, sender, mb, n, m), -1),
                                  sends.get(msg, -1), recvs.get(msg, -1),
                                  consumers.get(msg, -1))
    return transfers


__all__ = ["Program", "Row", "Transfer", "lower", "message", "message_parts", "FORWARD",
           "BACKWARD"]
