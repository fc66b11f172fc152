"""fp16 with dynamic loss scaling: an overflow skips the step on every rank, the scale backs
off, and grows again after ``growth_interval`` good steps. Tiny shapes: fp16 matmuls are slow
on CPU."""
from __future__ import annotations

import pytest
import torch

from pipeexec import launch

from exec_helpers import layouts_worker

pytestmark = pytest.mark.slow

PP, DP = 2, 2
SCALE = 2.0 ** 10
BASE = {"precision": "fp16", "loss_scale": SCALE, "loss_scale_growth_interval": 2}
CASES = [
    ("1f1b", {**BASE, "steps": 1}),
    # forced overflow at step 1 (an inf in one gradient of the last stage, one rank only)
    ("1f1b", {**BASE, "steps": 2, "inject": ("overflow:1",)}),
    ("zbv", {**BASE, "steps": 5, "inject": ("overflow:1",)}),
    # a genuine overflow: loss * 2^40 makes the fp16 logits' gradient inf
    ("interleaved", {**BASE, "steps": 1, "loss_scale": 2.0 ** 40}),
]


@pytest.fixture(scope="module")
def results():
    return launch(layouts_worker, PP * DP, (PP, DP, CASES), timeout=600)


def _key(i):
    name, changes = CASES[i]
    return (name, tuple(sorted(changes.items())))


def _params(results, key):
    out = {}
    for r in results:
        if r[key]["dp_rank"] == 0:
            out.update(r[key]["params"])
    return out


def test_overflow_skips_the_step_on_every_rank(results):
    one, two = _key(0), _key(1)
    for r in results:
        assert r[one]["skipped"] == [False]
        assert r[two]["skipped"] == [False, True]
        assert r[two]["loss_scales"] == [SCALE, SCALE]
        assert r[two]["final_scale"] == SCALE / 2
    # the skipped step left every parameter, on every rank and replica, as it was after step 0
    for r in results:
        for n, p in r[two]["params"].items():
            assert torch.equal(p, r[one]["params"][n]), f"rank {r[two]['pp_rank']},{r[two]['dp_rank']}: {n} changed"
    assert _params(results, one).keys() == _params(results, two).keys()


def test_scale_backs_off_then_grows(results):
    k = _key(2)
    for r in results:
        assert r[k]["skipped"] == [False, True, False, False, False]
        # used scale per step: back-off after step 1, growth after two good steps (2 and 3)
        assert r[k]["loss_scales"] == [SCALE, SCALE, SCALE / 2, SCALE / 2, SCALE]
        assert r[k]["final_scale"] == SCALE
        assert all(torch.isfinite(torch.tensor(r[k]["losses"])))


def test_genuine_overflow_is_detected(results):
    k = _key(3)
    for r in results:
        assert r[k]["skipped"] == [True]
        assert r[k]["final_scale"] == 2.0 ** 39
