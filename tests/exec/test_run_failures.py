"""How a run fails: it names the cause and leaves nothing behind.

* Several ranks fail: the rank with its own error is blamed, not the peer that first noticed
  its lost connection (which, its group torn down before the report is written, often exits
  first).
* A worker killed while writing a checkpoint is reported in the checkpoint save.
* SIGTERM or SIGHUP to the launcher stops the workers, removes the temporary folder, says so in
  one line and exits 143 / 129 (128 + the signal), as Ctrl-C does with 130.
* A reader that closes stdout early (``| head``) ends a command quietly (status 141).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from pipeexec import WorkerFailed, launch
from pipeexec.checkpoint import CheckpointOptions
from pipeexec.launching.launcher import lost_peer
from pipeexec.run.worker import WorkerArgs, run_training

from exec_helpers import TINY

WORKTREE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def allocation_fails_on_rank_0(board):
    """Rank 0 fails its allocation and, as run_training's ``finally`` does, tears the process
    group down before its error reaches the launcher; rank 1, waiting on it, sees the
    connection close first."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=30))
    try:
        if dist.get_rank() == 0:
            try:
                raise RuntimeError("could not allocate 1048576 GiB for the activations")
            finally:
                dist.destroy_process_group()
                time.sleep(0.5)                 # its report comes after its peer's
        dist.recv(torch.zeros(1), src=0)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_the_rank_with_its_own_error_is_blamed_not_the_peer_that_lost_it():
    with pytest.raises(WorkerFailed) as info:
        launch(allocation_fails_on_rank_0, 2, timeout=60)
    exc = info.value
    assert exc.rank == 0, str(exc)
    assert "could not allocate" in str(exc), str(exc)
    assert str(exc).endswith("(also failed: rank 1 (lost its connection))"), str(exc)


def test_lost_peer_tells_a_consequence_from_a_cause():
    assert lost_peer("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
                     "Connection closed by peer [127.0.0.1]:41097")
    assert lost_peer("Connection reset by peer")
    assert not lost_peer("RuntimeError: could not allocate 10 GiB")


def test_a_worker_killed_in_a_checkpoint_save_is_reported_there(tmp_path):
    cfg = TINY.with_flat(schedule="1f1b", pp=2, microbatches=2, micro_batch_size=1, steps=2)
    ckpt = CheckpointOptions(save=str(tmp_path / "ckpt"), save_interval=1,
                             fault="kill:1:1:before-rename")
    with pytest.raises(WorkerFailed) as info:
        launch(run_training, 2, (WorkerArgs(cfg, progress=False, checkpoint=ckpt),), timeout=120)
    msg = str(info.value)
    assert info.value.rank == 1, msg
    assert "rank 1 was killed by signal SIGKILL in the checkpoint save of iteration 1" in msg, msg


def _cli(*argv: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": WORKTREE, **kwargs.pop("env", {})}
    return subprocess.Popen([sys.executable, "-m", "pipeexec", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **kwargs)


@pytest.mark.parametrize("signum,status,group", [
    (signal.SIGTERM, 143, False),
    pytest.param(signal.SIGHUP, 129, True, marks=pytest.mark.slow)],
                         ids=["SIGTERM-to-the-launcher", "SIGHUP-to-the-session"])
def test_a_stop_signal_stops_the_workers_and_cleans_up(tmp_path, signum, status, group):
    tiny = ["--layers", "1", "--hidden", "16", "--heads", "2", "--seq-len", "8", "--vocab",
            "256", "--no-progress"]
    p = _cli("train", "--pp", "2", "--microbatches", "2", "--steps", "1000000", *tiny,
             env={"TMPDIR": str(tmp_path)}, start_new_session=True)
    try:
        line = p.stdout.readline()
        while line.startswith("pipeexec:"):                     # the banner and versions
            line = p.stdout.readline()
        assert line.startswith("step 0 (1 of"), line            # the workers run
        assert [f.name for f in tmp_path.iterdir() if f.name.startswith("pipeexec-")]
        workers = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True,
                                 text=True).stdout.split()
        assert len(workers) >= 2, workers
        if group:
            os.killpg(p.pid, signum)                            # a terminal's hang-up
        else:
            os.kill(p.pid, signum)                              # kill PID, systemd, timeout
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    name = signal.Signals(signum).name
    assert p.returncode == status, err
    assert err.strip() == f"pipeexec: stopped by {name}: stopped 2 workers", err
    assert not [f for f in tmp_path.iterdir() if f.name.startswith("pipeexec-")]
    left = subprocess.run(["pgrep", "-s", str(p.pid)], capture_output=True, text=True).stdout
    assert left.strip() == ""


@pytest.mark.parametrize("argv", [["compare", "--help"]] + [
    pytest.param(a, marks=pytest.mark.slow) for a in (["train", "--help"],
                                                      ["checkpoint", "--help"], ["--version"])])
def test_a_closed_stdout_ends_a_command_quietly(argv):
    p = _cli(*argv)
    p.stdout.close()                 # the reader is gone before the command writes (| head)
    err = p.stderr.read()
    assert p.wait(timeout=120) in (0, 141), err      # 141: 128 + SIGPIPE, as `yes | head`
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
