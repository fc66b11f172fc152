"""Memory meters for the profiler: what a rank holds for its in-flight microbatches.

* `HeldTensorMeter` (the profiler's meter on every device): counts exactly the
  bytes of the tensors the runtime keeps. During each F, a ``saved_tensors_hooks`` pair notes
  (by weak reference to the alias autograd keeps) every tensor autograd saves for backward,
  filed under that F's
  (stage, microbatch); after each F/B/I/W of a pair the pair's live storages are re-read, so a
  backward that frees its graph drops them. On top come the tensors in the runtime's own
  dictionaries (stage inputs, outputs waiting to be sent or kept for backward, posted receive
  buffers, gradients waiting, W's recorded gradients). A pair whose backward has run (its B
  or W) but whose saved storages are still alive is re-read at every later action until
  they die: a collective may hold a tensor that pins the pair's graph a moment past its
  ``wait()`` (gloo's worker thread releases the work after completing it), and a pair read
  only at its own actions would keep counting those storages to the end of the step.
  Storages are counted once each (a view shares its base's storage) and parameters are
  never counted: the result is activation memory, the quantity the schedule changes.
* `CudaMemoryMeter` (GPU, for comparison): ``torch.cuda.memory_allocated`` minus its value at
  the start of the step. Read at host time it runs ahead of the device (a tensor still being
  sent already counts as freed), so the profiler uses the held-tensor meter on GPUs too.
"""
from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

from pipesim.schedule.action import B, F, I, W, Action

_COMPUTE = (F, B, I, W)


def _identity(x: Any) -> Any:
    return x


def tensors_in(obj: Any, depth: int = 5) -> Iterator[torch.Tensor]:
    """Tensors inside nested lists, tuples, dicts and ``__slots__`` objects (e.g. W's state).

    Autograd nodes and other objects are not entered.
    """
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth <= 0 or obj is None:
        return
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from tensors_in(x, depth - 1)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from tensors_in(x, depth - 1)
    else:
        slots = getattr(type(obj), "__slots__", None)
        if slots:
            for name in slots:
                yield from tensors_in(getattr(obj, name, None), depth - 1)
        elif hasattr(obj, "tensor") and isinstance(getattr(obj, "tensor"), torch.Tensor):
            yield obj.tensor          # a posted receive (p2p.Pending)


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


class HeldTensorMeter:
    """Exact bytes of activations and saved tensors held by one rank's `PipelineRuntime`.

    ``exclude``: tensors whose storages are never counted (the rank's parameters), read each
    time the meter counts: a ZeRO-3 parameter's storage is allocated anew at every gather.
    """

    def __init__(self, runtime: Any, exclude: Iterable[torch.Tensor] = ()) -> None:
        self.runtime = runtime
        self._exclude_tensors = list(exclude)
        self._exclude = self._excluded()
        self._saved: dict[tuple[int, int], list] = {}          # (stage, mb) -> weakrefs
        self._pair_storages: dict[tuple[int, int], dict[int, int]] = {}
        self._refcount: dict[int, int] = {}                    # storage -> pairs holding it
        self._sizes: dict[int, int] = {}
        self._saved_bytes = 0
        self._lingering: set[tuple[int, int]] = set()          # backward done, storages alive
        self._hooks: saved_tensors_hooks | None = None

    def reset(self) -> None:
        """Start of a step: nothing to do, the count is exact at any moment."""

    def begin(self, action: Action) -> float:
        self._close_hooks()
        self._recheck()
        if action.op == F:
            self._lingering.discard((action.stage, action.microbatch))
            refs = self._saved.setdefault((action.stage, action.microbatch), [])

            def pack(t: torch.Tensor, refs: list = refs) -> torch.Tensor:
                # Hand autograd a detached alias, never ``t`` itself: a node that saves its own
                # output would otherwise hold a tensor whose grad_fn is that node, a C++
                # reference cycle that outlives a retain_graph backward (I then W) and leaks.
                d = t.detach()
                refs.append(weakref.ref(d))
                return d
            self._hooks = saved_tensors_hooks(pack, _identity)
            self._hooks.__enter__()
        return float(self.total())

    def finish(self, action: Action) -> float:
        self._close_hooks()
        if action.op in _COMPUTE:
            key = (action.stage, action.microbatch)
            self._refresh(key)
            if action.op in (B, W) and key in self._pair_storages:
                self._lingering.add(key)
        self._recheck()
        return float(self.total())

    def close(self) -> None:
        """Remove the saved-tensor hooks if an action failed between begin and finish."""
        self._close_hooks()

    def _close_hooks(self) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None

    def _recheck(self) -> None:
        """Re-read the pairs whose backward has run; forget those whose storages all died."""
        for key in list(self._lingering):
            self._refresh(key)
            if key not in self._pair_storages:
                self._lingering.discard(key)

    def _excluded(self) -> set[int]:
        return {t.untyped_storage().data_ptr() for t in self._exclude_tensors}

    def _refresh(self, key: tuple[int, int]) -> None:
        self._exclude = self._excluded()
        refs = self._saved.get(key)
        new: dict[int, int] = {}
        if refs:
            alive = []
            for r in refs:
                t = r()
                if t is None:
                    continue
                alive.append(r)
                ptr, size = _storage(t)
                if ptr not in self._exclude and size:
                    new[ptr] = size
            if alive:
                self._saved[key] = alive
            else:
                del self._saved[key]
        old = self._pair_storages.pop(key, {})
        for ptr in old:
            n = self._refcount[ptr] - 1
            if n:
                self._refcount[ptr] = n
            else:
                del self._refcount[ptr]
                self._saved_bytes -= self._sizes.pop(ptr)
        for ptr, size in new.items():
            n = self._refcount.get(ptr, 0)
            if n == 0:
                self._sizes[ptr] = size
                self._saved_bytes += size
            self._refcount[ptr] = n + 1
        if new:
            self._pair_storages[key] = new

    def total(self) -> int:
        """Saved-tensor bytes plus runtime-held tensors not already counted."""
        extra: dict[int, int] = {}
        for state in self.runtime.held_state():
            if not state:
                continue
            for t in tensors_in(state):
                ptr, size = _storage(t)
                if ptr not in self._sizes and ptr not in self._exclude:
                    extra[ptr] = size
        return self._saved_bytes + sum(extra.values())


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages behind ``tensors``, each storage once (views share one)."""
    seen: dict[int, int] = {}
    for t in tensors:
        ptr, size = _storage(t)
        if size:
            seen[ptr] = size
    return sum(seen.values())


class TrainingMemoryMeter:
    """Everything a rank holds during its steps: the activations (a `HeldTensorMeter` of the
    runtime) plus the training state (parameters, gradient buffers, fp32 masters, optimizer
    state: ``state()``, e.g. `Trainer.state_tensors`), each storage once.

    An observer of the runtime (read at every action's start and end) and a stage hook
    (`pipeexec.pipeline.runtime.StageHooks`, read inside every F, B, I and W): placed after
    the ZeRO holder's hooks, its ``before`` sees the stage's gathered parameters (ZeRO-3's
    transient) and its ``after`` the action's activations before the holder releases them.
    ZeRO-2/3's gradient buckets, each filled and reduced inside autograd's backward, are not
    seen (as a block recomputed inside its backward is not). ``peak``: the largest sum of the two at one reading;
    ``peak_state`` / ``peak_activations``: each one's largest alone."""

    owns_grads = False

    def __init__(self, runtime: Any, state, exclude: Iterable[torch.Tensor] = ()) -> None:
        self.activations = HeldTensorMeter(runtime, exclude=exclude)
        self.state = state
        self.peak = self.peak_state = self.peak_activations = 0

    def read(self) -> int:
        act, st = self.activations.total(), storage_bytes(self.state())
        self.peak_activations = max(self.peak_activations, act)
        self.peak_state = max(self.peak_state, st)
        self.peak = max(self.peak, act + st)
        return act + st

    def start(self, action: Action, step: int) -> None:
        self.activations.begin(action)
        self.read()

    def before(self, action: Action) -> None:
        self.read()

    def after(self, action: Action) -> None:
        self.activations.finish(action)
        self.read()

    def end(self, action: Action, step: int) -> None:
        self.activations.finish(action)
        self.read()


class CudaMemoryMeter:
    """Allocated device bytes above the step's starting point, at every action boundary."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._base: int | None = None

    def reset(self) -> None:
        """Call at the start of each profiled step (before its first action)."""
        self._base = None

    def begin(self, action: Action) -> float:
        now = torch.cuda.memory_allocated(self.device)
        if self._base is None:
            self._base = now
        return float(now - self._base)

    def finish(self, action: Action) -> float:
        return float(torch.cuda.memory_allocated(self.device) - (self._base or 0))
