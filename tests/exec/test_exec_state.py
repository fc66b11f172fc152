"""Model and optimizer state are keyed by global parameter name, so state written from one
layout loads into another: 2 steps on pp=2 (1f1b), then the 3rd step on pp=4 x dp=2 (zbv), gives
the 3-step single-process reference (the seam checkpoints' resharding builds on)."""
from __future__ import annotations

import pytest
import torch

from pipeexec import launch

from exec_helpers import (GLOBAL_BATCH, MICROBATCHES, TINY, merge_states, reference_train,
                          state_worker)

pytestmark = pytest.mark.slow


def test_state_moves_across_layouts():
    first = launch(state_worker, 2, (2, 1, "1f1b", 2, None), timeout=300)
    state = merge_states(first)
    assert state["iteration"] == 2 and state["updates"] == 2
    second = launch(state_worker, 8, (4, 2, "zbv", 1, state), timeout=300)
    final = merge_states(second)
    cfg = TINY.with_flat(microbatches=MICROBATCHES, micro_batch_size=GLOBAL_BATCH // MICROBATCHES)
    ref_losses, ref_params, _ = reference_train(cfg)
    losses = first[0]["losses"] + second[0]["losses"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert final["model"].keys() == ref_params.keys()
    for n, p in ref_params.items():
        torch.testing.assert_close(final["model"][n], p, rtol=1e-5, atol=1e-6, msg=n)
    assert final["iteration"] == 3
