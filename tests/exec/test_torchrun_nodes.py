"""Launch at scale: two torchrun "nodes" on one machine (``--nnodes 2``, one process each,
c10d rendezvous on 127.0.0.1), each running ``python -m pipeexec train --pp 2``, train as one
process does: the losses and the global gradient norms of every step equal the single-process
reference of the same flags (`exec_helpers.reference_run`: plain torch, the whole global
batch; fp32, rtol 1e-5)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from pipeexec.cli.train import config_from_args, train_parser
from pipeexec.launching.launcher import free_port

from exec_helpers import assert_grad_norms, reference_run

pytestmark = pytest.mark.slow

WORKTREE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAGS = ["--pp", "2", "--layers", "4", "--hidden", "16", "--heads", "2", "--seq-len", "8",
         "--vocab", "32", "--microbatches", "4", "--micro-batch-size", "2", "--steps", "3",
         "--clip-grad", "0.5", "--no-progress"]


def test_two_torchrun_nodes_train_as_one_process(tmp_path):
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not on PATH")
    port = free_port()
    metrics = tmp_path / "metrics.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": WORKTREE}
    nodes = [subprocess.Popen(
        [sys.executable, torchrun, "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node",
         "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
         "--rdzv-id", f"pipeexec-test-{port}", "-m", "pipeexec", "train", *FLAGS,
         "--metrics-out", str(metrics)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
        for n in (0, 1)]
    try:
        outs = [p.communicate(timeout=300)[0] for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(outs)
    got = json.loads(metrics.read_text())
    assert got["world_size"] == 2
    ref = reference_run(config_from_args(train_parser().parse_args(FLAGS)))
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref.losses), rtol=1e-5,
                               atol=0)
    assert_grad_norms(got["grad_norms"], ref.grad_norms, "two torchrun nodes")
