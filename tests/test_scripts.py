"""The scripts a user runs by hand behave on a machine that lacks what they need."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the scripts call `python`: the one running these tests (a venv need not be activated)
ENV = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


@pytest.mark.slow
def test_gpu_check_without_a_gpu_says_so_once_and_fails():
    from pipeexec.launching.devices import cuda_device_count

    if cuda_device_count() > 0:
        pytest.skip("a CUDA device is here: the script runs its checks")
    out = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env=ENV)
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert text.count("no CUDA device") == 1, text
    assert "Traceback" not in text and "CalledProcessError" not in text, text


def test_gpu_measure_without_a_gpu_says_so_once_and_fails(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the script measures it")
    out = subprocess.run(["bash", "scripts/gpu_measure.sh", str(tmp_path / "gpu")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, env=ENV)
    text = out.stdout + out.stderr
    assert out.returncode == 2
    assert text.count("no CUDA device") == 1 and "Traceback" not in text, text
    assert not list((tmp_path / "gpu").glob("*.json"))
