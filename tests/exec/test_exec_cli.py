"""The command line: `pipeexec train` (local workers) and torchrun give the losses of the
single-process reference (`--pp 1 --dp 1`), log a line per step and write the metrics file.
``python -m pipeexec`` and torchrun start their processes; the reference and the runs that
check other flags' losses call the same entry point in this process (`_train_here`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

MODEL = ["--layers", "2", "--hidden", "16", "--heads", "2", "--seq-len", "8", "--vocab", "64",
         "--steps", "3", "--seed", "3", "--lr", "0.01", "--no-progress", "--device", "cpu"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _train(tmp_path, name, launcher, *layout):
    out = tmp_path / f"{name}.json"
    proc = subprocess.run([*launcher, "train", *layout, *MODEL, "--metrics-out", str(out)],
                          capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def _train_here(tmp_path, name, *layout) -> dict:
    """`_train`'s metrics from ``pipeexec train`` run in this process (its ranks forked from
    here, no new Python importing torch first)."""
    from pipeexec.cli.main import main

    out = tmp_path / f"{name}.json"
    main(["train", *layout, *MODEL, "--metrics-out", str(out)])
    return json.loads(out.read_text())


PIPEEXEC = [sys.executable, "-m", "pipeexec"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _train_here(tmp_path_factory.mktemp("ref"), "ref", "--pp", "1", "--dp", "1",
                       "--microbatches", "4", "--micro-batch-size", "2")


def test_local_launcher_matches_single_process(tmp_path, reference):
    metrics, stdout = _train(tmp_path, "zbv", PIPEEXEC, "--schedule", "zbv", "--pp", "2", "--vpp",
                             "2", "--dp", "2", "--microbatches", "2", "--micro-batch-size", "2")
    assert len(metrics["losses"]) == len(metrics["step_times"]) == 3
    assert all(t > 0 for t in metrics["step_times"])
    assert metrics["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    assert reference["losses"][-1] < reference["losses"][0]   # it learns
    for k in (0, 1, 2):                     # numbered from 0, as in traces and reports
        assert f"step {k} ({k + 1} of 3) loss" in stdout
    assert "tokens/s" in stdout
    import torch
    assert metrics["versions"]["torch"] == torch.__version__ and metrics["versions"]["nccl"] is None
    assert f"torch {torch.__version__}" in stdout


def test_nccl_matching_run_matches_single_process(tmp_path, reference):
    # gpipe, pp 2, lookahead 1: the layout whose losses went wrong under NCCL's matching
    metrics = _train_here(tmp_path, "nccl", "--schedule", "gpipe", "--pp", "2",
                          "--microbatches", "4", "--micro-batch-size", "2", "--recv-lookahead",
                          "1", "--nccl-matching")
    assert metrics["config"]["nccl_matching"] is True
    assert metrics["losses"] == pytest.approx(reference["losses"], rel=1e-5)


def test_torchrun_matches_single_process(tmp_path, reference):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                "2", "-m", "pipeexec"]
    metrics, _ = _train(tmp_path, "tr", torchrun, "--schedule", "1f1b", "--pp", "2",
                        "--microbatches", "4", "--micro-batch-size", "2")
    assert metrics["world_size"] == 2
    assert metrics["losses"] == pytest.approx(reference["losses"], rel=1e-5)


def test_forward_only_run(tmp_path, reference):
    metrics = _train_here(tmp_path, "eval", "--schedule", "interleaved", "--pp", "2", "--vpp",
                          "2", "--microbatches", "4", "--micro-batch-size", "2", "--forward-only")
    # no update happens, so every step's loss is that step's batch under the initial weights;
    # step 0's equals the reference's first (pre-update) loss
    assert metrics["losses"][0] == pytest.approx(reference["losses"][0], rel=1e-5)
    assert all(metrics["skipped"])


def test_spawn_start_runs_training(tmp_path, reference):
    # what a local CUDA run uses (pipeexec.launching.devices.start_method_for): spawned workers, which
    # re-import pipeexec and unpickle the config; here on the CPU
    from pipeexec import launch
    from pipeexec.config import TrainConfig
    from pipeexec.run.worker import WorkerArgs, run_training
    cfg = TrainConfig.from_flat(schedule="1f1b", pp=2, microbatches=4, micro_batch_size=2, layers=2,
                                hidden=16, heads=2, seq_len=8, vocab=64, steps=3, seed=3, lr=0.01,
                                device="cpu")
    results = launch(run_training, 2, (WorkerArgs(cfg, progress=False),), timeout=300,
                     start_method="spawn")
    assert results[0].metrics["losses"] == pytest.approx(reference["losses"], rel=1e-5)
