"""Failure and bad input: a rank that raises, dies or hangs ends the whole run non-zero in
bounded time with a message naming the failed rank and its action; invalid layouts fail before
any process group exists, with the reason."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import pipesim
from pipeexec import ConfigError, WorkerFailed, launch

from exec_helpers import TINY, train_worker

CFG = TINY.with_flat(schedule="1f1b", pp=4, dp=1, microbatches=4, micro_batch_size=1, steps=3,
                     p2p_timeout=30.0, collective_timeout=30.0)


def _run_failing(config, timeout=60.0):
    start = time.monotonic()
    with pytest.raises(WorkerFailed) as info:
        launch(train_worker, config.world_size, (config,), timeout=timeout)
    return info.value, time.monotonic() - start


@pytest.mark.slow
def test_worker_that_raises_stops_the_run():
    exc, elapsed = _run_failing(CFG.with_flat(inject=("raise:2:1:2B1",)))
    msg = str(exc)
    assert exc.rank == 2
    assert "rank 2" in msg and "2B1" in msg and "step 1" in msg and "injected failure" in msg
    assert all(code != 0 for code in exc.exitcodes), exc.exitcodes
    assert elapsed < 15, f"took {elapsed:.1f} s"


@pytest.mark.slow
def test_killed_worker_stops_the_run():
    exc, elapsed = _run_failing(CFG.with_flat(schedule="zbv", vpp=2, pp=2, dp=2,
                                              inject=("exit:2:1:2F3",)))
    msg = str(exc)
    assert exc.rank == 2   # global rank 2 = pipeline rank 1 of replica 0, which holds stage 2
    assert "rank 2 was killed by signal SIGKILL" in msg and "action 2F3 of step 1" in msg, msg
    assert all(code != 0 for code in exc.exitcodes), exc.exitcodes
    assert elapsed < 15, f"took {elapsed:.1f} s"


@pytest.mark.slow
def test_hung_peer_times_out_naming_rank_peer_and_action():
    # rank 1 blocks before its first backward; rank 0 waits for 0RECV_B0 from it
    exc, elapsed = _run_failing(CFG.with_flat(pp=2, p2p_timeout=2.0, inject=("hang:1:0:1B0",)))
    msg = str(exc)
    assert exc.rank == 0, msg
    assert "0RECV_B0" in msg and "rank 1" in msg and "timed out after 2 s" in msg, msg
    assert elapsed < 12, f"took {elapsed:.1f} s"


@pytest.mark.parametrize("changes,reason", [
    ({"pp": 4, "vpp": 2, "layers": 5}, "7 layers"),
    ({"schedule": "no-such-schedule"}, "unknown schedule"),
    ({"schedule": "1f1b", "vpp": 2}, "vpp == 1"),
    ({"hidden": 15, "heads": 2}, "not a multiple of heads"),
    ({"precision": "fp8"}, "precision"),
    ({"boundaries": (2, 3)}, "need 3 values for 4 stages"),
    ({"boundaries": (2, 2, 5)}, "leave stage 1 empty"),
])
def test_invalid_layouts_fail_before_any_collective(changes, reason):
    with pytest.raises((ConfigError, pipesim.ScheduleError), match=reason):
        CFG.with_flat(**changes).validate(world_size=CFG.with_flat(**changes).world_size)


def test_world_size_mismatch():
    with pytest.raises(ConfigError,
                       match=r"world size 3 != tp \* cp \* pp \* dp = 1 \* 1 \* 4 \* 1"):
        CFG.validate(world_size=3)


def test_microbatch_count_the_schedule_rejects():
    # interleaved needs enough microbatches for its groups; find a count it rejects
    bad = next(m for m in range(1, 9)
               if _rejects("interleaved", 4, 2, m))
    with pytest.raises(pipesim.ScheduleError):
        CFG.with_flat(schedule="interleaved", vpp=2, microbatches=bad).validate()


def _rejects(name, pp, vpp, m) -> bool:
    try:
        pipesim.build_schedule(name, pp=pp, vpp=vpp, microbatches=m).validate()
        return False
    except pipesim.ScheduleError:
        return True


@pytest.mark.slow
def test_cli_reports_bad_layout_and_exits_non_zero(capfd):
    from cli_helpers import run_pipeexec

    proc = run_pipeexec(["train", "--pp", "2", "--dp", "2", "--nproc", "3", "--layers", "2"],
                        capfd)
    assert proc.returncode == 2
    assert "world size 3 != tp * cp * pp * dp = 1 * 1 * 2 * 2" in proc.stderr


@pytest.mark.slow
def test_workers_die_with_a_killed_launcher(tmp_path):
    code = ("import time\nfrom pipeexec import launch\n"
            "def w(board):\n    time.sleep(120)\n"
            "launch(w, 3)\n")
    # a killed launcher cannot remove its work folder: let it leave it here
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env)
    try:
        workers: list[str] = []
        deadline = time.monotonic() + 30
        while len(workers) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
            workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True,
                                     text=True).stdout.split()
        assert len(workers) == 3, workers
    finally:
        proc.kill()
        proc.wait()

    def alive(pid: str) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False
    deadline = time.monotonic() + 5
    while any(alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in workers), "workers outlived their launcher"
