"""Start N local workers by forking, watch them, and never hang.

Forking is the fast path (8 gloo ranks start in a fraction of a second, where spawn or torchrun
re-import torch in every worker for seconds each). It is only safe while the parent has no
threads, so the launcher refuses to fork a multi-threaded parent unless told to use "spawn".
What every worker would import on its own (torch's compiler front end, which the optimizer
imports; ``preload``: a Hugging Face family's modeling code) is imported in the parent first,
once, and the forked workers share it.
A run that may use CUDA must spawn (a forked child cannot initialise CUDA once the parent has):
the CLI picks the method with `pipeexec.launching.devices.start_method_for`.
Each worker gets torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)
and one intra-op thread (OMP_NUM_THREADS=1 semantics), so code written for torchrun runs as is.

Failure: a worker that raises writes its error (which names its rank and action) to a file and
exits non-zero; a worker that dies silently is seen through its exit code, and the shared
`ActionBoard` says which action it was in. After the first failure the launcher gives the
others a short bounded wait (``report_wait``) to fail and report too, then stops the rest
(SIGTERM, then SIGKILL) and raises `WorkerFailed` naming the cause: a rank killed from outside,
else the earliest rank's own error, a peer's lost connection only when no rank has its own
(a rank that fails tears its process group down before its report is written, so its peers'
"Connection closed by peer" often comes first). The run ends in bounded time; an overall
``timeout`` bounds it too.

SIGTERM and SIGHUP to the launcher end the run as Ctrl-C does (`Stopped`, a KeyboardInterrupt:
workers stopped, temporary folder removed), where Python would otherwise die at once and leave
both behind.
"""
from __future__ import annotations

import importlib
import multiprocessing
import os
import pickle
import signal
import socket
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait as wait_sentinels
from pathlib import Path
from typing import Any

from .board import ActionBoard
from .cpu_quota import RankQuotas


class Stopped(KeyboardInterrupt):
    """The launcher was sent ``signum`` (SIGTERM, SIGHUP): the workers were stopped and the
    run's files removed on the way out. ``exit_status``: the shell's 128 + signal number."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.signal_name = signal.Signals(signum).name
        self.exit_status = 128 + signum


# signals handled as Ctrl-C while workers run (SIGINT is Python's KeyboardInterrupt already)
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
# what a rank reports when a peer went away first: a consequence, not the cause
_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe",
              "connection refused", "socket closed", "connection closed",
              "no route to host", "peer closed")


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
    # Ctrl-C and a hang-up reach the whole process group: the launcher alone handles them,
    # stopping workers; SIGTERM (the launcher's stop) ends a worker at once.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
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
           cpus_per_rank: float | None = None, report_wait: float = 2.0,
           preload: Sequence[str] = ()) -> list[Any]:
    """Run ``fn(board, *args)`` in ``nproc`` workers; return their results by rank.

    Raises `WorkerFailed` (naming the failed rank that caused it, its action and its error)
    when a worker fails, after at most ``report_wait`` seconds for the others' reports and
    stopping the rest; or when ``timeout`` seconds pass. Raises `Stopped` on SIGTERM or SIGHUP
    (from the main thread, whose handlers it sets while the workers run).
    ``cpus_per_rank``: confine each worker to that many CPUs (`pipeexec.launching.cpu_quota.RankQuotas`;
    raises `QuotaUnavailable` before starting any worker when the machine does not allow it).
    ``preload``: modules every worker will import (`pipeexec.models.worker_modules`), imported
    here first when forking, so that the workers share them instead of each importing its
    own; one that cannot be imported is left to the workers, which report it as their error.
    """
    if start_method == "fork":
        # before the thread check: an import that started a thread is refused as any thread is
        for name in preload:
            try:
                importlib.import_module(name)
            except ImportError:
                pass
    if start_method == "fork" and threading.active_count() > 1:
        raise RuntimeError(f"refusing to fork: the parent has {threading.active_count()} threads "
                           "(forked children would inherit their locks); use start_method='spawn'")
    if start_method == "fork":
        import sys
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            raise RuntimeError("refusing to fork: CUDA is initialised in the parent (children "
                               "could not use it); use start_method='spawn'")
        if torch is not None:
            # every worker's optimizer imports torch._dynamo (about a CPU second each):
            # imported once here, the forked workers share it
            import torch._dynamo  # noqa: F401
    if timeout is not None and not (timeout > 0 and timeout < float("inf")):
        raise ValueError(f"launch: timeout must be a finite number of seconds > 0, got {timeout!r}")
    previous = _catch_stop_signals()
    try:
        quotas = RankQuotas(nproc, cpus_per_rank) if cpus_per_rank is not None else None
        try:
            return _launch(fn, nproc, args, timeout, start_method, env, grace, quotas,
                           report_wait)
        finally:
            if quotas is not None:
                quotas.close()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _catch_stop_signals() -> dict:
    """Raise `Stopped` on SIGTERM / SIGHUP while the workers run (main thread only: elsewhere
    Python cannot set handlers, and the caller's own stay). Returns the handlers replaced."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def stop(signum, frame):
        raise Stopped(signum)

    return {signum: signal.signal(signum, stop) for signum in _STOP_SIGNALS}


def _launch(fn: Callable[..., Any], nproc: int, args: tuple, timeout: float | None,
            start_method: str, env: dict | None, grace: float,
            quotas: RankQuotas | None, report_wait: float) -> list[Any]:
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
        settle: float | None = None       # after the first failure: when to stop waiting
        try:
            while running:
                now = time.monotonic()
                left = None if deadline is None else deadline - now
                if left is not None and left <= 0 and settle is None:
                    where = "; ".join(f"rank {r}: {board.describe(r)}" for r in sorted(running.values()))
                    timed_out = WorkerFailed(f"run timed out after {timeout:g} s ({where})",
                                             min(running.values()), None)
                    break
                if settle is not None:
                    left = settle - now
                    if left <= 0:
                        break
                ready = wait_sentinels(list(running), timeout=0.5 if left is None else min(0.5, left))
                for sentinel in ready:
                    r = running.pop(sentinel)
                    procs[r].join()
                    if procs[r].exitcode != 0:
                        failed.append(r)
                if failed and settle is None:
                    # the others' reports: the first to exit is often a peer of the cause
                    settle = time.monotonic() + report_wait
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


def lost_peer(message: str) -> bool:
    """Whether a rank's error says only that a peer went away (its connection closed or
    reset): what the peers of a failed rank report, not a cause."""
    low = message.lower()
    return any(sign in low for sign in _PEER_LOST)


def _failure(procs: list, failed: list[int], board: ActionBoard, workdir: Path) -> WorkerFailed:
    """Name the root cause from every report: a rank killed from outside (no report) before
    its peers, which only noticed it; else the earliest rank's own error; else the earliest
    lost connection; else the first rank that died. The others are named after it."""
    reports = []
    for r in range(len(procs)):
        f = workdir / f"error-{r}.txt"
        if f.exists():
            when, msg, *_ = f.read_text().split("\n", 2) + [""]
            reports.append((lost_peer(msg), float(when), r, msg))
    silent = [r for r in failed if not (workdir / f"error-{r}.txt").exists()]
    if reports and not silent:
        _, _, r, msg = min(reports)
        if not msg.startswith(f"rank {r} "):
            msg = f"rank {r} failed in {board.describe(r)}: {msg}"
    else:
        r = silent[0] if silent else failed[0]
        msg = _death(procs[r], r, board)
    others = sorted((r2, peer) for peer, _, r2, _ in reports if r2 != r)
    if others:
        msg += " (also failed: " + ", ".join(
            f"rank {r2}" + (" (lost its connection)" if peer else "") for r2, peer in others) + ")"
    return WorkerFailed(msg, r, procs[r].exitcode)


def _death(proc, rank: int, board: ActionBoard) -> str:
    code = proc.exitcode
    how = (f"was killed by signal {signal.Signals(-code).name}" if code is not None and code < 0
           else f"exited with code {code}")
    return f"rank {rank} {how} in {board.describe(rank)}"
