"""The bidirectional dualpipe in the executor: half the microbatches fed at rank 0, half at rank
pp-1, every rank holding model part r and a copy of part pp-1-r under the same global names
(tied: `pipeexec.training.tied`). After 3 optimizer steps the losses and every parameter equal
single-process training (plain torch, whole global batch), and the two instances of each
parameter are bitwise equal. Bounds as test_exec_equivalence: fp32 rtol 1e-5, atol 1e-6.
"""
from __future__ import annotations

import functools

import pytest
import torch

import pipesim
from pipesim.schedule.io import schedule_to_csv, schedule_to_json
from pipeexec import launch

from exec_helpers import (GLOBAL_BATCH, MICROBATCHES, TINY, assert_grad_norms, layouts_worker,
                          reference_run, reference_train)

pytestmark = pytest.mark.slow
REF_CFG = TINY.with_flat(microbatches=MICROBATCHES, micro_batch_size=GLOBAL_BATCH // MICROBATCHES)


@functools.lru_cache(maxsize=None)
def reference():
    losses, params, _ = reference_train(REF_CFG)
    return losses, params


@pytest.mark.parametrize("pp", [2, 4])
def test_dualpipe_trains_as_one_process(pp):
    results = launch(layouts_worker, pp, (pp, 1, [("dualpipe", {})]), timeout=600)
    ref_losses, ref_params = reference()
    reference_norms = reference_run(REF_CFG).grad_norms
    (key,) = results[0].keys()
    for r in results:          # each part's two copies summed, counted once in the norm
        assert_grad_norms(r[key]["grad_norms"], reference_norms, f"pp={pp}")
    cfg = results[0][key]["config"]
    m = cfg.plan.microbatches
    schedule = cfg.build_schedule()
    assert schedule.has_copies and schedule.num_parts == pp and schedule.vpp == 2
    seen: dict[str, list[torch.Tensor]] = {}
    for r in results:
        entry = r[key]
        torch.testing.assert_close(torch.tensor(entry["losses"]), torch.tensor(ref_losses),
                                   rtol=1e-5, atol=0)
        for name, p in entry["params"].items():
            seen.setdefault(name, []).append(p)
        # losses are taken at the last stage of each route: direction A's on rank pp-1,
        # direction B's (fed at rank pp-1) on rank 0
        want = {0: set(range(m // 2, m)), pp - 1: set(range(m // 2))}.get(entry["pp_rank"], set())
        assert set(entry["fwd_losses"]) == want, entry["pp_rank"]
    assert seen.keys() == ref_params.keys()
    for name, copies in seen.items():
        assert len(copies) == 2, f"{name}: {len(copies)} instances, expected a part and its copy"
        assert torch.equal(copies[0], copies[1]), f"{name}: the two copies differ"
        torch.testing.assert_close(copies[0], ref_params[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda msg: f"dualpipe pp={pp}: {name}: {msg}")


def test_dualpipe_schedule_file_runs_as_itself(tmp_path):
    """The JSON keeps routes and copies, so a dualpipe file is the run's schedule; torch's CSV
    cannot say them and is refused with the reason."""
    s = pipesim.build_schedule("dualpipe", pp=2, microbatches=4)
    path = tmp_path / "dualpipe.json"
    schedule_to_json(s, path)
    cfg = TINY.with_flat(schedule=str(path), pp=2, vpp=1, microbatches=4, micro_batch_size=2)
    assert cfg.build_schedule().with_recv_lookahead(0) == s   # the run posts receives 1 early
    with pytest.raises(pipesim.ScheduleError, match="vpp = 1, the run vpp = 2"):
        cfg.with_flat(vpp=2).build_schedule()
    with pytest.raises(pipesim.ScheduleError, match="different routes"):
        schedule_to_csv(s)
