"""Activation recomputation (``--recompute none|selective|full [--recompute-layers N]``).

* Losses and parameters equal the unsplit single-process model's (fp32, rtol 1e-5) for 1F1B,
  interleaved and ZB-V (whose I/W split runs autograd over the recomputed graph twice) at pp 2.
* What a stage holds after its forward, counted by the profiler's held-tensor meter: with full
  recomputation exactly each recomputed block's input (b x s x h fp32 values), and less than
  without; ``--recompute-layers N`` recomputes the first N blocks of the stage only.
"""
from __future__ import annotations

import pytest
import torch

from exec_helpers import TINY, assert_grad_norms, layouts_worker, reference_run
from pipeexec import launch
from pipeexec.config import ConfigError
from pipeexec.models import layer_stack
from pipeexec.partition import by_layers
from pipeexec.pipeline.stage import build_stage
from pipeexec.measuring.memory import HeldTensorMeter
from pipesim.schedule.action import Action

MODES = ({"recompute": "none"}, {"recompute": "selective"}, {"recompute": "full"},
         {"recompute": "full", "recompute_layers": 1})


class _Runtime:
    def held_state(self):
        return ({},) * 8


def held_after_forward(cfg, x):
    spec = layer_stack(cfg)
    layers, par = cfg.plan.model.layers, cfg.plan.parallelism
    bounds = (0, 1, layers + 1, layers + 2)            # stage 1: the blocks alone
    stage = build_stage(spec, 1, bounds, seed=0, device=torch.device("cpu"), dtype=torch.float32)
    stage.set_recompute(par.recompute, spec.kinds()[1:layers + 1], par.recompute_layers)
    meter = HeldTensorMeter(_Runtime(), exclude=list(stage.parameters()))
    meter.begin(Action("F", 1, 0))
    y = stage(x)
    held = meter.finish(Action("F", 1, 0))
    return held, y


def test_full_recomputation_holds_each_block_input_only():
    cfg = TINY.with_flat(layers=3)
    b, s, h = 4, cfg.plan.model.seq_length, cfg.plan.model.hidden
    x = torch.randn(b, s, h, requires_grad=True)
    none, y0 = held_after_forward(cfg, x)
    full, y1 = held_after_forward(cfg.with_flat(recompute="full"), x)
    one, _ = held_after_forward(cfg.with_flat(recompute="full", recompute_layers=1), x)
    selective, _ = held_after_forward(cfg.with_flat(recompute="selective"), x)
    torch.testing.assert_close(y0, y1, rtol=0, atol=0)
    assert full == 3 * b * s * h * 4                    # three block inputs, fp32
    assert full < one < none and selective <= none
    # recompute_layers=1: block 0 keeps its input, blocks 1 and 2 (same shapes: a third of
    # `none` each) what they save
    assert none % 3 == 0 and one == b * s * h * 4 + 2 * none // 3


def test_recompute_layers_needs_full():
    # the rule is the plan's (pipesim.Parallelism), named with the flags that set it
    with pytest.raises(ConfigError, match=r"recompute_layers: only with recompute='full' "
                                          r"\(--recompute, --recompute-layers\)"):
        TINY.with_flat(recompute="selective", recompute_layers=1).validate()
    with pytest.raises(ConfigError, match="'some' is not one of none, selective, full"):
        TINY.with_flat(recompute="some").validate()


@pytest.mark.slow
def test_losses_and_parameters_unchanged_by_recomputation():
    cases = [(name, mode) for name in ("1f1b", "interleaved", "zbv") for mode in MODES]
    results = launch(layouts_worker, 2, (2, 1, cases), timeout=400)
    for name, mode in cases:
        key = (name, tuple(sorted(mode.items())))
        cfg = results[0][key]["config"]
        ref = reference_run(cfg)
        ref_losses, ref_params = ref.losses, ref.params
        last = cfg.plan.parallelism.pp - 1
        losses = next(r[key]["losses"] for r in results if r[key]["pp_rank"] == last)
        assert losses == pytest.approx(ref_losses, rel=1e-5), (name, mode)
        for r in results:
            assert_grad_norms(r[key]["grad_norms"], ref.grad_norms, f"{name} {mode}")
            for n, p in r[key]["params"].items():
                torch.testing.assert_close(p, ref_params[n], rtol=1e-5, atol=1e-6,
                                           msg=f"{name} {mode} {n}")
