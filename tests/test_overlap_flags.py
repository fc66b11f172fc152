"""Megatron's two data-parallel overlaps as two switches: ``--no-overlap-grad-reduce`` exposes
the gradient reduce alone, ``--no-overlap-param-gather`` the distributed optimizer's gather
alone, ``--no-overlap`` both; each exposes its own time, and the two add up to both."""
from __future__ import annotations

import json

import pytest

from pipesim.cli import main

BASE = ["simulate", "1f1b", "--model", "llama3-8b", "--tp", "1", "--pp", "2", "--dp", "8",
        "--zero", "1", "--global-batch-size", "32", "--hardware", "H100"]


def _run(tmp_path, *flags: str) -> tuple[float, dict]:
    out = tmp_path / f"r{len(list(tmp_path.iterdir()))}.json"
    plan = tmp_path / f"p{len(list(tmp_path.iterdir()))}.json"
    assert main([*BASE, *flags, "--report-out", str(out), "--save-plan", str(plan)]) == 0
    par = json.loads(plan.read_text())["parallelism"]
    return json.loads(out.read_text())["step_time"], par


def test_each_overlap_switch_exposes_its_own_collective_and_they_add_up(tmp_path, capsys):
    base, par = _run(tmp_path)
    assert par["overlap_grad_reduce"] and par["overlap_param_gather"]
    grad, par = _run(tmp_path, "--no-overlap-grad-reduce")
    assert not par["overlap_grad_reduce"] and par["overlap_param_gather"]
    gather, par = _run(tmp_path, "--no-overlap-param-gather")
    assert par["overlap_grad_reduce"] and not par["overlap_param_gather"]
    both, par = _run(tmp_path, "--no-overlap")
    assert not par["overlap_grad_reduce"] and not par["overlap_param_gather"]
    assert base < gather < grad < both      # fp32 gradients reduced, bf16 parameters gathered
    assert both - base == pytest.approx((grad - base) + (gather - base), rel=1e-6)
