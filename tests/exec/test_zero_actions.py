"""ZeRO runs from the program (`pipesim.schedule.sharding`): the fast test (2 forked gloo
ranks, dp 2, 1 step).

* The runtime runs exactly the lowered program: the actions its observers see are
  ``schedule.with_sharding(Sharding(zero, grad_reduce)).actions(rank)`` (UNSHARD / RESHARD /
  REDUCE_GRAD included), under ZeRO-2 and ZeRO-3, per step and per microbatch, 1F1B and ZB-V
  (two stages a rank, split backward);
* and it trains as one process on the whole batch: losses, every parameter, the logged
  gradient norm (fp32, rtol 1e-5, as tests/exec/test_exec_equivalence.py).
"""
from __future__ import annotations

import functools

import pytest
import torch

from pipeexec import launch
from pipeexec.topology import destroy_topology, init_topology
from pipeexec.run.assemble import assemble
from pipeexec.training.train import train
from pipesim.schedule.sharding import Sharding

from exec_helpers import assert_grad_norms, layout_config, reference_run

CASES = [("1f1b", 2, "per_step"), ("1f1b", 3, "per_microbatch"), ("zbv", 3, "per_step"),
         ("zbv", 2, "per_microbatch")]


def config(schedule: str, zero: int, grad_reduce: str):
    return layout_config(schedule, 1, 2, zero=zero, grad_reduce=grad_reduce, steps=1)


class Seen:
    def __init__(self) -> None:
        self.actions: list[str] = []

    def start(self, action, step: int) -> None:
        self.actions.append(str(action))


def worker(board):
    topo = init_topology(1, 2, device="cpu", timeout=120)
    out = {}
    try:
        for schedule, zero, reduce in CASES:
            cfg = config(schedule, zero, reduce)
            seen = Seen()
            t = assemble(cfg, topo, board=board, recorder=seen)
            res = train(t)
            program = t.schedule.with_sharding(Sharding(zero, reduce)).actions(topo.pp_rank)
            out[(schedule, zero, reduce)] = {
                "seen": seen.actions, "program": [str(a) for a in program],
                "losses": res.losses, "norms": res.grad_norms,
                "params": {n: p.detach().clone() for n, p in t.named_parameters().items()}}
    finally:
        destroy_topology(topo)
    return out


@functools.lru_cache(maxsize=None)
def runs():
    return launch(worker, 2, (), timeout=300)


@functools.lru_cache(maxsize=None)
def reference(schedule: str):
    return reference_run(config(schedule, 0, "per_step"))


@pytest.mark.parametrize("schedule,zero,grad_reduce", CASES)
def test_the_runtime_runs_the_programs_sharding_actions(schedule, zero, grad_reduce):
    for r in runs():
        got = r[(schedule, zero, grad_reduce)]
        assert got["seen"] == got["program"]
        assert any("REDUCE_GRAD" in a for a in got["seen"])
        assert any("UNSHARD" in a for a in got["seen"]) == (zero == 3)


@pytest.mark.parametrize("schedule,zero,grad_reduce", CASES)
def test_equals_one_process(schedule, zero, grad_reduce):
    ref = reference(schedule)
    for r in runs():
        got = r[(schedule, zero, grad_reduce)]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref.losses),
                                   rtol=1e-5, atol=0)
        assert_grad_norms(got["norms"], ref.grad_norms, f"{schedule} zero {zero} {grad_reduce}")
        assert got["params"].keys() == ref.params.keys()
        for n, p in ref.params.items():
            torch.testing.assert_close(got["params"][n], p, rtol=1e-5, atol=1e-6, msg=n)
