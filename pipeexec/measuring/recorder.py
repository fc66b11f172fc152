"""`ActionProfiler`: the runtime's recorder that times every action of the profiled steps.

An observer of the runtime (`pipeexec.pipeline.runtime.ActionObserver`): the runtime calls
``start(action, step)`` and ``end(action, step)`` around each action and ``message`` with the
bytes of each send or receive posted. Outside
the profiled step range both return at once, and with no profiler at all the runtime adds
nothing (no synchronisation, no clock reads): profiling costs only what it measures.

Clocks: on CPU a timestamp is a ``perf_counter`` reading taken on the spot; on GPU it is a CUDA
event recorded on the current stream, resolved to seconds after the step (event times are
placed on the CPU clock through one reference event taken, once, when profiling begins). So a
GPU span is when the device ran the action, not when Python launched it.

Receive waits: the runtime posts a receive at RECV_* and waits for it inside the compute action
that needs the tensor, calling the recorder's ``wait_start`` / ``wait_end`` around the wait. The
profiler marks both, so the computation proper starts when the data is there and the wait
becomes the RECV row (the simulator's meaning of a RECV row: time the rank spent waiting for
the message).
On a GPU the wait is a stream wait (`pipeexec.pipeline.p2p`): ``wait_start``'s event is recorded on
the compute stream before the stream wait and ``wait_end``'s after it, so the RECV row is the
time the device's compute stream stood still for the data (with a host-blocking wait both
events would sit back to back on the stream: zero long). A SEND row runs from its posting
event on the sender's compute stream to that arrival; the transfer on the NCCL stream itself is
not timed.

Memory: an optional meter (:mod:`pipeexec.measuring.memory`) is read before each action's start
timestamp and after its end timestamp, so its own cost falls between actions, not inside them.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from pipesim.schedule.action import OVERLAP_F_B, Action


class MemoryMeter(Protocol):
    """Bytes held by this rank's runtime, read around every profiled action."""

    def reset(self) -> None: ...                       # before a profiled step's first action
    def begin(self, action: Action) -> float: ...
    def finish(self, action: Action) -> float: ...


@dataclass(frozen=True)
class ActionRecord:
    """One executed action on this rank, times in seconds on this rank's clock.

    ``wait_start`` / ``wait_end``: the receive wait inside a compute action (NaN when it waited
    on nothing). ``nbytes``: bytes sent or received by a SEND / RECV action. ``mem_start`` /
    ``mem_end``: the memory meter's reading before and after the action (NaN without a meter).
    ``cpu_start`` / ``cpu_end``: the thread's CPU time (``time.thread_time``) at start and end
    (CPU runs; NaN on GPU): the work the rank did, whatever else shared its core.
    """

    step: int
    op: str
    stage: int
    microbatch: int
    start: float
    end: float
    wait_start: float
    wait_end: float
    nbytes: int
    mem_start: float
    mem_end: float
    cpu_start: float = math.nan
    cpu_end: float = math.nan


class ActionProfiler:
    """Records the actions of steps ``first <= step < stop`` on one rank.

    ``clock`` is injectable so tests can give ranks skewed clocks; ``device`` decides between
    perf_counter (CPU) and CUDA events (GPU). Pass ``memory`` now or set ``.memory`` later
    (the meter needs the runtime, which is built after the recorder).
    """

    def __init__(self, first: int, stop: int, *, device: torch.device | str = "cpu",
                 clock: Callable[[], float] = time.perf_counter,
                 memory: MemoryMeter | None = None,
                 cpu_clock: Callable[[], float] = time.thread_time) -> None:
        if not 0 <= first < stop:
            raise ValueError(f"profiled steps {first}:{stop}: need 0 <= first < stop")
        self.first, self.stop = first, stop
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.clock = clock
        self.cpu_clock = cpu_clock
        self.memory = memory
        self._raw: list[tuple] = []
        self._cur: Action | None = None
        self._last_step = -1
        self._ref: tuple[Any, float] | None = None   # (CUDA event, CPU time) reference

    # -- the recorder protocol ----------------------------------------------------------------
    def start(self, action: Action, step: int) -> None:
        if action.op == OVERLAP_F_B:
            return             # its parts are recorded one by one, inside it (the runtime's
                               # OVERLAP_F_B runs them in turn)
        if not self.first <= step < self.stop:
            self._cur = None
            return
        if step != self._last_step:
            self._last_step = step
            if self.memory is not None:
                self.memory.reset()
        mem = self.memory.begin(action) if self.memory is not None else math.nan
        self._cur = action
        self._step = step
        self._bytes = 0
        self._w0 = self._w1 = None
        self._mem0 = mem
        self._t0 = self._mark()
        self._c0 = self._cpu()

    def end(self, action: Action, step: int) -> None:
        if self._cur is None or action.op == OVERLAP_F_B:
            return
        t1 = self._mark()
        c1 = self._cpu()
        mem = self.memory.finish(action) if self.memory is not None else math.nan
        if action != self._cur or step != self._step:
            raise RuntimeError(f"profiler: end({action}, step {step}) does not match "
                               f"start({self._cur}, step {self._step})")
        self._raw.append((step, action.op, action.stage, action.microbatch, self._t0, t1,
                          self._w0, self._w1, self._bytes, self._mem0, mem, self._c0, c1))
        self._cur = None

    # -- called by the runtime around a receive wait (inside a compute action) -----------------
    def wait_start(self, recv_action: Action, step: int) -> None:
        if self._cur is not None:
            self._w0 = self._mark()

    def wait_end(self, recv_action: Action, step: int) -> None:
        if self._cur is not None:
            self._w1 = self._mark()

    # -- called by the runtime for a send or receive posted inside an action -------------------
    def message(self, action: Action, nbytes: int) -> None:
        if self._cur is not None:
            self._bytes += nbytes

    # -- results --------------------------------------------------------------------------------
    def records(self) -> list[ActionRecord]:
        """Every recorded action with times resolved to seconds on this rank's clock.

        On GPU this synchronises the device once (needed to read the events).
        """
        if self.cuda and self._raw:
            torch.cuda.synchronize(self.device)
        nan = math.nan
        out = []
        for step, op, stage, mb, t0, t1, w0, w1, nbytes, m0, m1, c0, c1 in self._raw:
            out.append(ActionRecord(step, op, stage, mb, self._seconds(t0), self._seconds(t1),
                                    nan if w0 is None else self._seconds(w0),
                                    nan if w1 is None else self._seconds(w1),
                                    int(nbytes), float(m0), float(m1), c0, c1))
        return out

    def clear(self) -> None:
        self._raw.clear()

    # -- timestamps -------------------------------------------------------------------------
    def _cpu(self) -> float:
        return math.nan if self.cuda else self.cpu_clock()

    def _mark(self) -> Any:
        if not self.cuda:
            return self.clock()
        if self._ref is None:
            # One synchronisation, at the first profiled action: ties event time to the clock.
            torch.cuda.synchronize(self.device)
            ref = torch.cuda.Event(enable_timing=True)
            ref.record()
            ref.synchronize()
            self._ref = (ref, self.clock())
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _seconds(self, mark: Any) -> float:
        if not self.cuda:
            return float(mark)
        ref, cpu = self._ref
        return cpu + ref.elapsed_time(mark) / 1e3

