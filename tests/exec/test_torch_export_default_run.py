"""pipeexec's default run (receives posted one computation early: ``--recv-lookahead 1``)
exported to torch's "compute_comms" CSV runs in torch's own ``_PipelineScheduleRuntime``
(loaded with its ``_load_csv``) and gives, in one step on gloo over 2 ranks, the gradients of
one process: 1F1B, interleaved and ZB-V (fp32, rtol 1e-5). The slow file
(`test_torch_export`) covers more schedules and pp 4."""
from __future__ import annotations

import torch

from pipeexec import launch
from pipeexec.config import TrainConfig
from pipesim.schedule.io import schedule_to_csv

from test_torch_export import reference_grads, torch_worker

CASES = [("1f1b", 1, 4), ("interleaved", 2, 4), ("zbv", 2, 4)]


def test_the_default_runs_export_gives_single_process_gradients_in_torch():
    cases = []
    for name, vpp, m in CASES:
        s = TrainConfig.from_flat(schedule=name, pp=2, vpp=vpp, microbatches=m,
                                  layers=6).build_schedule()
        assert s.recv_lookahead == 1          # pipeexec's default run
        cases.append((name, vpp, m, schedule_to_csv(s, with_comms=True)))
    results = launch(torch_worker, 2, (2, cases), timeout=180)
    for name, vpp, m, _ in cases:
        ref = reference_grads(2 * vpp, m)
        got = {k: v for r in results for k, v in r[name].items()}
        assert got.keys() == ref.keys(), name
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6,
                                       msg=lambda msg: f"{name} stage {k}: {msg}")
