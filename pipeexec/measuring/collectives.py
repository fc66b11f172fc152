"""The collective benchmark: gloo all-reduce, reduce-scatter, all-gather and all-to-all timed
between ``p`` ranks on this host, and each fitted to pipesim's alpha-beta model.

Why: a plan's tensor-parallel, ZeRO and expert-parallel collectives are priced by
:mod:`pipesim.plan.collectives` (ring convention, one latency and bandwidth); with one pair
for every collective, fitted to all-reduce alone, the others are a guess. Here each one is
measured at the message sizes a run uses and fitted on its own, per group size, and ``pipeexec
calibrate-hardware`` stores the fits as the hardware file's ``collectives``.

How:

* ``p`` ranks are forked by :func:`pipeexec.launching.launcher.launch` (one intra-op thread
  each, OMP_NUM_THREADS=1), joined in a gloo group on 127.0.0.1, with malloc keeping freed
  memory as a CPU run's workers do (:mod:`pipeexec.malloc`);
* per collective and size ``warmup`` untimed calls (gloo sets up its buffers on the first),
  then ``repeats`` rounds over every (collective, size), one timed call each after a barrier
  (so that a burst of other load on a shared machine slows a round, not every repeat of one
  point); a call's time is from the last rank's entry to the last rank's exit
  (``CLOCK_MONOTONIC``, one clock for every process of a host), i.e. what the collective adds
  once every rank has arrived; a point's is its median repeat;
* sizes are counted as the model counts them (``n``: the all-reduce's tensor, the
  reduce-scatter's input, the all-gather's output, the all-to-all's per-rank input), rounded
  down to whole float32 elements that ``p`` divides;
* every wait has a timeout (``init_process_group``'s, each collective's and barrier's
  ``work.wait(timeout)``, the launcher's for the whole run): a hung or dead rank is reported by
  rank, collective and size, never waited for;
* each (collective, p) is fitted by :func:`pipesim.plan.collectives.fit` (least squares in
  relative error, over the sizes).

:func:`run_message_sizes` gives the sizes a run sends (a plan's tensor-parallel activation,
its gradient buckets): the default sweep covers the executor's runs on this machine
(tests/exec/test_calibrate_hardware.py checks it).
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from pipesim.plan.collectives import COLLECTIVES, Fit, fit
from pipesim.plan.derive import rank_parts    # each pipeline rank's parts, as the plan's tail
from pipesim.units import KiB, MiB

DDP_BUCKET_BYTES = 25 * MiB  # pipeexec.training.ddp.GradBuffer's bucket_bytes default
# 4 KiB (the tiny GPT's activation is 8 KiB) up to a whole gradient bucket, the largest message
# a run sends. Not beyond: from 32 MiB glibc serves gloo's internal buffers with fresh mmap
# pages on every call (keep_freed_memory cannot keep them), and on the development VM an
# all-gather of 32 MiB took 3-4x its 25 MiB time, a cost no run here pays.
SIZES = (4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, DDP_BUCKET_BYTES)
QUICK_SIZES = (4 * KiB, 256 * KiB, 4 * MiB)   # small, and large enough to outgrow noise
GROUPS = (2, 4)             # the tp and dp group sizes a run on this machine uses


class CollectiveBenchmarkError(RuntimeError):
    """A rank of the benchmark failed or a collective did not complete in time. ``action``:
    the collective and size it was in (a rank's message then reaches the launcher's report as
    it is, as a pipeline action's error does)."""

    def __init__(self, message: str, action: str = "") -> None:
        super().__init__(message)
        self.action = action


@dataclass(frozen=True)
class Timing:
    """One measured point: ``name`` of ``nbytes`` over ``p`` ranks took ``seconds`` (the
    median repeat; ``samples``: every repeat)."""

    name: str
    p: int
    nbytes: int
    seconds: float
    samples: tuple[float, ...]


@dataclass(frozen=True)
class Benchmark:
    """Every point measured and each (collective, p)'s fit."""

    timings: tuple[Timing, ...]
    fits: tuple[Fit, ...]

    def fit_of(self, name: str, p: int) -> Fit:
        for f in self.fits:
            if f.name == name and f.p == p:
                return f
        raise KeyError(f"no fit of {name} at p={p}")

    def rows(self) -> list[tuple[str, int, int, float, float, float]]:
        """``(collective, p, bytes, measured s, fitted s, fitted / measured)`` per point."""
        out = []
        for t in self.timings:
            predicted = self.fit_of(t.name, t.p).time(t.nbytes)
            out.append((t.name, t.p, t.nbytes, t.seconds, predicted, predicted / t.seconds))
        return out

    def errors(self, name: str | None = None, p: int | None = None) -> list[float]:
        """``|fitted / measured - 1|`` per point (of one collective and/or p)."""
        return [abs(r - 1) for n, q, _, _, _, r in self.rows()
                if (name is None or n == name) and (p is None or q == p)]

    def hardware_rows(self, kinds: tuple[str, ...] = ("intra", "inter")) -> tuple:
        """The fits as :class:`pipesim.hardware.Hardware`'s ``collectives`` rows, for each link
        kind in ``kinds`` (on one host both links are the loopback measured here)."""
        return tuple((k, f.name, f.p, f.latency, f.bandwidth) for k in kinds for f in self.fits)


def _elements(nbytes: int, p: int) -> int:
    """Float32 elements of a ``nbytes`` message that ``p`` ranks split evenly (at least p)."""
    return max(p, (int(nbytes) // 4) // p * p)


def _clock() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def _rank(board: Any, sizes: tuple[int, ...], names: tuple[str, ...], warmup: int,
          repeats: int, timeout: float) -> dict:
    """One rank: ``{(name, nbytes): [(start, end), ...]}`` on the host's monotonic clock."""
    import torch
    import torch.distributed as dist

    from ..malloc import keep_freed_memory

    keep_freed_memory()         # as a CPU run's workers do: no fresh pages for each message
    rank, p = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    wait = timedelta(seconds=timeout)
    dist.init_process_group("gloo", rank=rank, world_size=p, timeout=wait)
    # torch 2.13 names them *_single; older releases only have the *_tensor names
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def done(post, what: str) -> None:
        """Post a collective (``post()`` returns its work) and wait for it, ``timeout`` at most."""
        try:
            work = post()
        except Exception as exc:
            raise CollectiveBenchmarkError(f"rank {rank} failed in {what} over {p} gloo ranks: "
                                           f"{type(exc).__name__}: {exc}", what) from None
        try:
            work.wait(timeout=wait)
        except RuntimeError as exc:
            raise CollectiveBenchmarkError(
                f"rank {rank} waited {timeout:g} s for {what} over {p} gloo ranks, which did not "
                f"complete (a peer died or is stuck): {exc}", what) from None

    # one buffer set for every size (views of the largest): a rank holds 2.5x the largest
    big = _elements(max(sizes), p)
    whole_buf, other_buf, part_buf = torch.zeros(big), torch.zeros(big), torch.zeros(big // p)

    def call(name: str, n: int):
        whole, other, part = whole_buf[:n], other_buf[:n], part_buf[:n // p]
        if name == "all_reduce":
            return dist.all_reduce(whole, async_op=True)
        if name == "reduce_scatter":
            return reduce_scatter(part, whole, async_op=True)
        if name == "all_gather":
            return all_gather(whole, part, async_op=True)
        return dist.all_to_all_single(other, whole, async_op=True)

    points = list(dict.fromkeys((name, _elements(nbytes, p)) for name in names for nbytes in sizes))
    for name, n in points:
        for _ in range(warmup):
            done(lambda: call(name, n), f"{name} of {4 * n} bytes (warm-up)")
    # rounds over every point, so that a burst of other load on a shared machine slows one
    # repeat of many points rather than every repeat of one
    out: dict = {(name, 4 * n): [] for name, n in points}
    for _ in range(repeats):
        for name, n in points:
            done(lambda: dist.barrier(async_op=True), f"the barrier before {name} of {4 * n} bytes")
            t0 = _clock()
            done(lambda: call(name, n), f"{name} of {4 * n} bytes")
            out[(name, 4 * n)].append((t0, _clock()))
    dist.destroy_process_group()
    return out


def measure(p: int, sizes: tuple[int, ...] = SIZES, names: tuple[str, ...] = COLLECTIVES,
            warmup: int = 2, repeats: int = 9, timeout: float = 60.0,
            run_timeout: float = 900.0) -> list[Timing]:
    """Time ``names`` at ``sizes`` over ``p`` forked gloo ranks (see the module's docstring).
    ``timeout``: seconds any one wait may take; ``run_timeout``: the whole measurement."""
    from ..launching.launcher import WorkerFailed, launch

    unknown = [n for n in names if n not in COLLECTIVES]
    if unknown:
        raise ValueError(f"unknown collective(s) {', '.join(unknown)}; known: "
                         f"{', '.join(COLLECTIVES)}")
    if not isinstance(p, int) or p < 2:
        raise ValueError(f"a collective benchmark needs p >= 2 ranks, got {p!r}")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    bad = [s for s in sizes if not s > 0]
    if not sizes or bad:
        raise ValueError(f"message sizes must be > 0 bytes, got {list(sizes)}")
    try:
        ranks = launch(_rank, p, (tuple(int(s) for s in sizes), tuple(names), warmup, repeats,
                                  timeout), timeout=run_timeout)
    except WorkerFailed as exc:
        raise CollectiveBenchmarkError(f"collective benchmark over {p} gloo ranks: {exc}") from None
    out = []
    for (name, nbytes), spans in ranks[0].items():
        per_rank = [r[(name, nbytes)] for r in ranks]
        # each repeat: from the last rank's entry to the last rank's exit
        samples = tuple(max(e for _, e in rep) - max(s for s, _ in rep) for rep in zip(*per_rank))
        out.append(Timing(name, p, nbytes, statistics.median(samples), samples))
    return out


def benchmark(groups: tuple[int, ...] = GROUPS, sizes: tuple[int, ...] = SIZES,
              names: tuple[str, ...] = COLLECTIVES, **kw: Any) -> Benchmark:
    """Measure every collective at every size for each group size, and fit each
    (collective, p) separately."""
    timings: list[Timing] = []
    for p in groups:
        timings += measure(p, sizes, names, **kw)
    fits = []
    for p in groups:
        for name in names:
            pts = [(t.nbytes, t.seconds) for t in timings if t.name == name and t.p == p]
            try:
                fits.append(fit(pts, name, p))
            except ValueError as exc:       # other load swamped the sizes' differences
                raise CollectiveBenchmarkError(
                    f"{exc} (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores: "
                    "measure on a quieter machine, or with larger sizes or more repeats)") from None
    return Benchmark(tuple(timings), tuple(fits))


def run_message_sizes(plan: Any, bucket_bytes: int = DDP_BUCKET_BYTES) -> dict[str, float]:
    """The collective message sizes (bytes) a run of ``plan`` sends: the activation a
    tensor-parallel all-reduce carries (``e b s h``, per cp rank), and the data-parallel
    gradient all-reduce's buckets (a rank's fp32 gradients cut in ``bucket_bytes`` pieces: the
    largest and the last). Torch-free."""
    par, model = plan.parallelism, plan.model
    e = 2 if par.precision in ("bf16", "fp16", "fp8") else 4
    out = {"activation": float(e * par.micro_batch_size * (model.seq_length / par.cp)
                               * model.hidden)}
    costs = plan.derive()
    per_rank = [sum(costs.stage_params[st]["dense"] + costs.stage_params[st]["expert"]
                    for st in sts) * 4 for sts in rank_parts(plan, len(costs.stage_params))]
    grads = max(per_rank)
    out["gradient bucket"] = float(min(grads, bucket_bytes))
    rest = grads % bucket_bytes
    if grads > bucket_bytes and rest:
        out["last gradient bucket"] = float(rest)
    return out
