"""Start N local workers by forking, watch them, and never hang.

Forking is the fast path (8 gloo ranks start in a fraction of a second, where spawn or torchrun
re-import torch in every worker for seconds each). It is only safe while the parent has no
threads, so the launcher refuses to fork a multi-threaded parent unless told to use "spawn".
A run that may use CUDA must spawn (a forked child cannot initialise CUDA once the parent has):
the CLI picks the method with `pipeexec.launching.devices.start_method_for`.
Each worker gets torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)
and one intra-op thread (OMP_NUM_THREADS=1 semantics), so code written for torchrun runs as is.

Failure: a worker that raises writes its error (which names its rank and action) to a file and
exits non-zero; a worker that dies silently is seen through its exit code, and the shared
`ActionBoard` says which action it was in. Either way the launcher then stops every other
worker (SIGTERM, then SIGKILL) and raises `WorkerFailed` naming the rank and the action: the
run ends in bounded time. An overall ``timeout`` bounds the whole run too.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait as wait_sentinels
from pathlib import Path
from typing import Any

from .board import ActionBoard
from .cpu_quota import RankQuotas


class WorkerFailed(RuntimeError):
    def __init__(self, message: str, rank: int, exitcode: int | None) -> None:
        super().__init__(message)
        self.rank, self.exitcode = rank, exitcode
        self.exitcodes: list[int | None] = []   # every worker's, filled in by launch()
        self.elapsed: float = 0.0               # seconds from start to all workers stopped


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_interface() -> str | None:
    """The loopback interface's name (``lo`` on Linux), or None where there is none: a local
    run's gloo transport listens there, not on an address other machines reach."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


def _die_with_parent() -> None:
    """Linux: have the kernel kill this worker if the launcher dies (no orphaned ranks)."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _worker(fn: Callable, rank: int, nproc: int, port: int, workdir: str, board: ActionBoard,
            args: tuple, env: dict, parent: int, quotas: RankQuotas | None = None) -> None:
    _die_with_parent()
    if os.getppid() != parent:     # the launcher died before prctl took effect
        os._exit(1)
    # Ctrl-C reaches the whole process group: the launcher alone handles it, stopping workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if quotas is not None:
        try:
            quotas.join(rank)
        except OSError as exc:
            (Path(workdir) / f"error-{rank}.txt").write_text(
                f"{time.time()!r}\nrank {rank} could not join its CPU quota cgroup: {exc}\n")
            os._exit(1)
    os.environ.update(env)
    loopback = loopback_interface()
    if loopback is not None:        # gloo's listening sockets on this machine alone, as the store's
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    code = 0
    try:
        import torch
        torch.set_num_threads(1)
        result = fn(board, *args)
        tmp = Path(workdir) / f"result-{rank}.pkl.tmp"
        with open(tmp, "wb") as f:
            pickle.dump(result, f)
        tmp.rename(Path(workdir) / f"result-{rank}.pkl")
    except BaseException as exc:   # noqa: BLE001  (reported to the parent, then exit non-zero)
        code = 1
        try:
            # A PipelineError already says "rank R ... failed in action A of step K: ..."
            msg = str(exc) if hasattr(exc, "action") else (
                f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
            (Path(workdir) / f"error-{rank}.txt").write_text(
                f"{time.time()!r}\n{msg}\n{traceback.format_exc()}")
        except Exception:
            pass
    finally:
        # Skip interpreter teardown: a dead peer can make process-group destructors block.
        os._exit(code)


def launch(fn: Callable[..., Any], nproc: int, args: tuple = (), *, timeout: float | None = None,
           start_method: str = "fork", env: dict | None = None, grace: float = 2.0,
           cpus_per_rank: float | None = None) -> list[Any]:
    """Run ``fn(board, *args)`` in ``nproc`` workers; return their results by rank.

    Raises `WorkerFailed` (naming the first failed rank, its action and its error) as soon as a
    worker fails, after stopping the others; or when ``timeout`` seconds pass.
    ``cpus_per_rank``: confine each worker to that many CPUs (`pipeexec.launching.cpu_quota.RankQuotas`;
    raises `QuotaUnavailable` before starting any worker when the machine does not allow it).
    """
    if start_method == "fork" and threading.active_count() > 1:
        raise RuntimeError(f"refusing to fork: the parent has {threading.active_count()} threads "
                           "(forked children would inherit their locks); use start_method='spawn'")
    if start_method == "fork":
        import sys
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            raise RuntimeError("refusing to fork: CUDA is initialised in the parent (children "
                               "could not use it); use start_method='spawn'")
    quotas = RankQuotas(nproc, cpus_per_rank) if cpus_per_rank is not None else None
    try:
        return _launch(fn, nproc, args, timeout, start_method, env, grace, quotas)
    finally:
        if quotas is not None:
            quotas.close()


def _launch(fn: Callable[..., Any], nproc: int, args: tuple, timeout: float | None,
            start_method: str, env: dict | None, grace: float,
            quotas: RankQuotas | None) -> list[Any]:
    ctx = multiprocessing.get_context(start_method)
    board = ActionBoard(nproc, ctx)
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="pipeexec-") as workdir:
        procs = [ctx.Process(target=_worker, args=(fn, r, nproc, port, workdir, board, args, env or {},
                                   os.getpid(), quotas),
                             name=f"pipeexec-rank{r}", daemon=False) for r in range(nproc)]
        for p in procs:
            p.start()
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        running = {p.sentinel: r for r, p in enumerate(procs)}
        failed: list[int] = []
        timed_out: WorkerFailed | None = None
        try:
            while running:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    where = "; ".join(f"rank {r}: {board.describe(r)}" for r in sorted(running.values()))
                    timed_out = WorkerFailed(f"run timed out after {timeout:g} s ({where})",
                                             min(running.values()), None)
                    break
                ready = wait_sentinels(list(running), timeout=0.5 if left is None else min(0.5, left))
                for sentinel in ready:
                    r = running.pop(sentinel)
                    procs[r].join()
                    if procs[r].exitcode != 0:
                        failed.append(r)
                if failed:
                    break
        finally:
            if running:
                _stop([procs[r] for r in running.values()], grace)
        if failed or timed_out is not None:
            exc = timed_out if timed_out is not None else _failure(procs, failed, board, Path(workdir))
            exc.exitcodes = [p.exitcode for p in procs]
            exc.elapsed = time.monotonic() - started
            raise exc
        results = []
        for r in range(nproc):
            with open(Path(workdir) / f"result-{r}.pkl", "rb") as f:
                results.append(pickle.load(f))
        return results


def _stop(procs: list, grace: float) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)


def _failure(procs: list, failed: list[int], board: ActionBoard, workdir: Path) -> WorkerFailed:
    """Name the root cause: the earliest reported error, else the first rank that died."""
    reports = []
    for r in range(len(procs)):
        f = workdir / f"error-{r}.txt"
        if f.exists():
            when, msg, *_ = f.read_text().split("\n", 2) + [""]
            reports.append((float(when), r, msg))
    if reports:
        # A rank that died without a report (killed) is more likely the root than its peers,
        # which only noticed it.
        silent = [r for r in failed if not (workdir / f"error-{r}.txt").exists()]
        if silent:
            r = silent[0]
            return WorkerFailed(_death(procs[r], r, board), r, procs[r].exitcode)
        _, r, msg = min(reports)
        if not msg.startswith(f"rank {r} "):
            msg = f"rank {r} failed in {board.describe(r)}: {msg}"
        return WorkerFailed(msg, r, procs[r].exitcode)
    r = failed[0]
    return WorkerFailed(_death(procs[r], r, board), r, procs[r].exitcode)


def _death(proc, rank: int, board: ActionBoard) -> str:
    code = proc.exitcode
    how = (f"was killed by signal {signal.Signals(-code).name}" if code is not None and code < 0
           else f"exited with code {code}")
    return f"rank {rank} {how} in {board.describe(rank)}"
