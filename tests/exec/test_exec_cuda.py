"""The equivalence tests on CUDA: every schedule on one GPU (all stages on one rank: local
hand-offs, split backward on the GPU) and, with enough GPUs, every layout over NCCL, against the
CPU fp32 reference. GPU matmuls reduce in another order than the CPU's, so the bounds are looser
than the CPU tests' (losses rtol 1e-4, parameters rtol 1e-4 / atol 1e-5; TF32 is off).
Workers are spawned, not forked: asking whether CUDA is available may initialise the driver in
this process, and a forked child could not use it."""
from __future__ import annotations

import pytest
import torch

import pipesim
from pipeexec import launch

from exec_helpers import (GLOBAL_BATCH, MICROBATCHES, TINY, choose_microbatches, layouts_worker,
                          reference_train)

pytestmark = [pytest.mark.cuda, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

REF_CFG = TINY.with_flat(microbatches=MICROBATCHES, micro_batch_size=GLOBAL_BATCH // MICROBATCHES)


@pytest.fixture(scope="module")
def reference():
    losses, params, _ = reference_train(REF_CFG)
    return losses, params


def _check(results, dp, reference, label_prefix):
    ref_losses, ref_params = reference
    for key in results[0]:
        label = f"{label_prefix} {key[0]} {dict(key[1])}"
        params = {}
        for r in results:
            if r[key]["dp_rank"] == 0:
                params.update(r[key]["params"])
        torch.testing.assert_close(torch.tensor(results[0][key]["losses"]), torch.tensor(ref_losses),
                                   rtol=1e-4, atol=0, msg=lambda m: f"{label}: {m}")
        assert params.keys() == ref_params.keys()
        for n in ref_params:
            torch.testing.assert_close(params[n], ref_params[n], rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"{label}: {n}: {m}")


def runnable(pp: int, dp: int) -> list[str]:
    """The schedules that build at this layout with the fixed global batch (DualPipe needs an
    even pp: it is left out at pp 1)."""
    return [name for name in pipesim.schedule_names() if choose_microbatches(name, pp, dp)]


def test_every_schedule_on_one_gpu(reference):
    assert set(pipesim.schedule_names()) - set(runnable(1, 1)) == {"dualpipe"}
    cases = [(name, {}) for name in runnable(1, 1)]
    results = launch(layouts_worker, 1, (1, 1, cases, "cuda"), timeout=600, start_method="spawn")
    _check(results, 1, reference, "pp=1 cuda")


LAYOUTS = [(2, 1), (2, 2), (4, 1), (4, 2)]


@pytest.mark.parametrize("pp,dp", LAYOUTS, ids=[f"pp{p}-dp{d}" for p, d in LAYOUTS])
def test_layouts_over_nccl(pp, dp, reference):
    if torch.cuda.device_count() < pp * dp:
        pytest.skip(f"needs {pp * dp} GPUs, have {torch.cuda.device_count()}")
    print(f"torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}")
    cases = [(name, {"recv_lookahead": la}) for name in runnable(pp, dp) for la in (1, 2)]
    results = launch(layouts_worker, pp * dp, (pp, dp, cases, "cuda"), timeout=600,
                     start_method="spawn")
    _check(results, dp, reference, f"pp={pp} dp={dp} nccl")
