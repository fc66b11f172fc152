"""The split-backward probe: what I and W cost on each of a rank's stages, beside F and B.

A run of a schedule without I/W (1F1B, GPipe, interleaved) shows only B, and predicting a Zero
Bubble schedule from it needs I and W. An even split of B misses two facts of this executor:
the first stage has no input gradient (its I is a no-op and its W the whole backward), and the
split costs more than B (two autograd passes, and W reads back what B had just used; about 10%
on a CPU). So after the profiled steps every rank times, on each of its stages, one microbatch
through F + B and through F + I + W, outside the schedule, with another forward (untimed)
before B, before I and between I and W, as a schedule has other work there: nothing is sent, no gradient
reaches the gradient buffer (the passes return their gradients and they are dropped), and the
random state is restored afterwards. All ranks probe at once, as they compute during a step.

`probe_layers` times, the same way, the embedding and the head alone on the stages that hold
them: re-cutting costs to another partition needs each layer kind's cost, and solved from the
stages' sums they come out as small differences of large numbers (stage 0 minus a block).
"""
from __future__ import annotations

import statistics
import time
import weakref
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge, saved_tensors_hooks

from ..pipeline.backward import backward_input, full_backward
from ..pipeline.stage import Stage
from .memory import _identity

OPS = ("F", "B", "I", "W")


def probe_split(trainer: Any, repeats: int = 5) -> dict[int, dict[str, Any]]:
    """``{stage: {"wall": {op: seconds}, "cpu": {op: seconds}, "ratio_wall": {"I": I/B, "W":
    W/B}, "ratio_cpu": {...}, "freed_at_I": bytes}}`` for this rank's stages whose input shape
    is known (medians over ``repeats``; CPU times are NaN on GPU). ``freed_at_I``: the bytes of
    saved activations that I releases (`_SavedBytes`), which a run without I cannot show."""
    return _outside_training(trainer, _probe, repeats)


def _outside_training(trainer: Any, body: Any, repeats: int) -> dict:
    """``body(trainer, device, generator, tokens, targets, repeats)`` on the first microbatch,
    with the random state restored afterwards (the probes must not change training)."""
    device = trainer.topology.device
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        gen = torch.Generator(device=device)
        gen.manual_seed(trainer.config.runtime.seed)
        tokens, targets = _first_microbatch(trainer, device)
        return body(trainer, device, gen, tokens, targets, repeats)


def _probe(trainer: Any, device: torch.device, gen: torch.Generator, tokens: torch.Tensor,
           targets: torch.Tensor, repeats: int) -> dict:
    outputs: dict[int, torch.Tensor] = {}
    out: dict[int, dict[str, dict[str, float]]] = {}
    for s in sorted(trainer.stages):
        stage = trainer.stages[s]
        x = _stage_input(trainer, stage, s, tokens, gen, device, outputs)
        if x is None:
            continue                                   # shape unknown (no message seen)
        params = trainer.runtime.params[s]
        times = _Times()
        freed: list[float] = []
        for _ in range(repeats):
            y = _measure(trainer, stage, x, params, targets, gen, device, times, freed)
            if not stage.is_last:
                outputs[s] = y                         # the input of a local next stage
        out[s] = {"wall": times.medians("wall"), "cpu": times.medians("cpu"),
                  "ratio_wall": _ratios(times.wall), "ratio_cpu": _ratios(times.cpu),
                  "freed_at_I": statistics.median(freed)}
    return out


def probe_layers(trainer: Any, repeats: int = 5) -> dict[int, dict[str, dict[str, Any]]]:
    """``{stage: {kind: {"wall": {op: seconds}, "cpu": {...}, "share_wall": {op: layer/stage},
    "share_cpu": {...}}}}`` for this rank's stages holding an embedding (their first layer) or
    a head (their last layer), timed alone as `probe_split` times a stage (F, B, I, W; the
    embedding's input needs no gradient, so its I is a no-op and W its whole backward).
    ``share``: the median over repeats of the layer's time over its whole stage's, both timed
    in the same repeat (a change of load between repeats cancels); calibration multiplies the
    stage's scheduled cost by it. Stages whose input shape is unknown are left out."""
    return _outside_training(trainer, _probe_layers, repeats)


def _probe_layers(trainer: Any, device: torch.device, gen: torch.Generator,
                  tokens: torch.Tensor, targets: torch.Tensor, repeats: int) -> dict:
    kinds = trainer.spec.kinds()
    out: dict[int, dict[str, dict[str, Any]]] = {}
    for s in sorted(trainer.stages):
        stage = trainer.stages[s]
        ids = list(stage.layer_ids)
        edges = [(kind, pos) for kind, pos, holds in (("embedding", 0, stage.is_first),
                                                      ("head", len(ids) - 1, stage.is_last))
                 if holds and kinds[ids[pos]] == kind]
        x = _stage_input(trainer, stage, s, tokens, gen, device, {})
        if not edges or x is None:
            continue
        params = trainer.runtime.params[s]
        out[s] = {}
        for kind, pos in edges:
            layer = stage.layers[str(ids[pos])]
            alone = Stage(s, range(ids[pos], ids[pos] + 1), [layer], is_first=pos == 0 and
                          stage.is_first, is_last=pos == len(ids) - 1 and stage.is_last)
            owned = {id(p) for p in layer.parameters()}
            layer_params = [p for p in params if id(p) in owned]
            if pos == 0:
                y = x
            else:
                with torch.no_grad():
                    y = x
                    for i in ids[:pos]:
                        y = stage.layers[str(i)](y)
            whole = _Times()
            part = _Times()
            for _ in range(repeats):
                _measure(trainer, stage, x, params, targets, gen, device, whole)
                _measure(trainer, alone, y, layer_params, targets, gen, device, part)
            out[s][kind] = {"wall": part.medians("wall"), "cpu": part.medians("cpu"),
                            "share_wall": part.shares(whole, "wall"),
                            "share_cpu": part.shares(whole, "cpu")}
    return out


class _Times:
    """Per op, the wall and CPU seconds of each repeat, in order."""

    def __init__(self) -> None:
        self.wall: dict[str, list[float]] = {op: [] for op in OPS}
        self.cpu: dict[str, list[float]] = {op: [] for op in OPS}

    def add(self, op: str, t: tuple[float, float]) -> None:
        """One repeat's ``(wall, cpu)`` seconds of ``op``."""
        self.wall[op].append(t[0])
        self.cpu[op].append(t[1])

    def medians(self, clock: str) -> dict[str, float]:
        return {op: statistics.median(v) for op, v in getattr(self, clock).items()}

    def shares(self, whole: "_Times", clock: str) -> dict[str, float]:
        """Median over the repeats of this op's time over ``whole``'s in the same repeat."""
        mine, theirs = getattr(self, clock), getattr(whole, clock)
        return {op: statistics.median(a / b if b > 0 else float("nan")
                                      for a, b in zip(mine[op], theirs[op])) for op in OPS}


def _measure(trainer: Any, stage: Any, x: torch.Tensor, params: Any, targets: torch.Tensor,
             gen: torch.Generator, device: torch.device, into: _Times,
             freed: list[float] | None = None) -> torch.Tensor:
    """One repeat of the split probe's timing on ``stage``: F + B, then F + I + W, each
    backward after another (untimed) forward, nothing sent and the gradients dropped. ``freed``
    gets the bytes of saved activations I released; returns the first forward's output."""
    output = None
    for split in (False, True):
        leaf = x.detach().requires_grad_(x.is_floating_point() and not stage.is_first)
        saved = _SavedBytes(params)
        with saved:
            (root, grad), t = _timed(device, lambda: _forward(trainer, stage, leaf, targets, gen))
        into.add("F", t)
        edge = get_gradient_edge(root)
        stage_input = leaf if leaf.requires_grad else None
        _other_work(stage, leaf)
        if not split:
            _, t = _timed(device, lambda: full_backward(edge, grad, stage_input, params))
            into.add("B", t)
            output = root.detach()
            continue
        held = saved.live()
        (_, _, wgrad), t = _timed(device, lambda: backward_input(edge, grad, stage_input, params))
        into.add("I", t)
        root = edge = None          # as the runtime drops them: W keeps only its join nodes
        if freed is not None:
            freed.append(float(held - saved.live()))
        _other_work(stage, leaf)
        _, t = _timed(device, lambda: wgrad.compute(params))
        into.add("W", t)
    return output


def _first_microbatch(trainer: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    plan = trainer.config.plan
    tokens, targets = trainer.data.microbatches(0, trainer.topology.dp_rank, plan.parallelism.dp,
                                                plan.microbatches)[0]
    return tokens.to(device), targets.to(device)


def _stage_input(trainer: Any, stage: Any, s: int, tokens: torch.Tensor, gen: torch.Generator,
                 device: torch.device, outputs: dict[int, torch.Tensor]) -> torch.Tensor | None:
    """What stage ``s`` computes on in a probe: the tokens on the first stage, a local previous
    stage's output, else random values of the shape its messages had (None: none seen yet)."""
    specs = trainer.p2p.activation_specs() if trainer.p2p is not None else {}
    if stage.is_first:
        x = tokens
    elif s - 1 in outputs:
        x = outputs[s - 1]
    elif s - 1 in specs:
        shape, dtype = specs[s - 1]
        x = torch.randn(shape, generator=gen, device=device).to(dtype)
    else:
        return None
    return x.to(trainer.dtype) if x.is_floating_point() else x


class _SavedBytes:
    """Bytes of the tensors autograd saves for backward inside the ``with`` block that are still
    alive (each storage once, parameters never), tracked by weak reference to the detached
    alias handed to autograd, as the profiler's memory meter does (`memory.HeldTensorMeter`).
    I frees what only the graph above W's join nodes saved (on the last stage, the loss
    computation's), since W keeps only those nodes."""

    def __init__(self, params: Any) -> None:
        self._exclude = {p.untyped_storage().data_ptr() for p in params}
        self._refs: list[tuple[weakref.ref, int, int]] = []
        self._hooks = saved_tensors_hooks(self._pack, _identity)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        d = t.detach()          # never ``t``: a saved output would hold its own node (a cycle)
        st = d.untyped_storage()
        if st.data_ptr() not in self._exclude:
            self._refs.append((weakref.ref(d), st.data_ptr(), st.nbytes()))
        return d

    def __enter__(self) -> "_SavedBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)

    def live(self) -> int:
        return sum(dict((ptr, n) for ref, ptr, n in self._refs if ref() is not None).values())


def _ratios(t: dict[str, list[float]]) -> dict[str, float]:
    """Median over the repeats of I/B and W/B of the same repeat (the pair ran seconds apart,
    so a change of load between repeats cancels)."""
    return {op: statistics.median(x / b if b > 0 else float("nan") for x, b in zip(t[op], t["B"]))
            for op in ("I", "W")}


def _forward(trainer: Any, stage: Any, x: torch.Tensor, targets: torch.Tensor,
             gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The stage's output (or scaled loss on the last stage) and the gradient to start from."""
    with torch.enable_grad():
        y = stage(x)
        if stage.is_last:
            return trainer.spec.loss_fn(y.float(), targets), None
    return y, torch.randn(y.shape, generator=gen, device=y.device).to(y.dtype)


def _other_work(stage: Any, x: torch.Tensor) -> None:
    """A forward of another microbatch, untimed: in a schedule a backward never follows its own
    forward at once, and a W comes long after its I, so the caches hold other data by then."""
    with torch.no_grad():
        stage(x.detach())


def _timed(device: torch.device, fn: Any) -> tuple[Any, tuple[float, float]]:
    """(wall seconds, CPU seconds) of ``fn``. On CUDA the wall time is the device's, between
    two CUDA events on the current stream (synchronize + perf_counter would add the launch
    overhead, large next to a small stage's kernels); CPU time is then NaN."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        value = fn()
        end.record()
        end.synchronize()
        return value, (start.elapsed_time(end) / 1e3, float("nan"))
    w0, c0 = time.perf_counter(), time.thread_time()
    value = fn()
    return value, (time.perf_counter() - w0, time.thread_time() - c0)


