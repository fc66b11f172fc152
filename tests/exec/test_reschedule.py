"""Profile, re-schedule, run: `--schedule zb-auto --memory-limit X` profiles ZB-H1, searches
zb-auto from the measured costs, switches every rank to it, and trains on: the losses and
parameters stay those of single-process training (any valid schedule computes the same step)."""
import pytest
import torch

from pipeexec import launch
from pipeexec.config import ConfigError
from pipeexec.launching.worker import run_training

from exec_helpers import TINY, reference_train

pytestmark = pytest.mark.slow


def worker(board, config):
    metrics = run_training(board, config, progress=False)
    return {"losses": metrics["losses"], "reschedule": metrics.get("reschedule")}


def test_zb_auto_from_the_runs_own_costs_trains_like_a_single_process():
    cfg = TINY.replace(schedule="zb-auto", pp=2, microbatches=4, micro_batch_size=2, steps=5,
                       memory_limit=1e9, reschedule_after=2)
    results = launch(worker, 2, (cfg,), timeout=300)
    ref_losses, _, _ = reference_train(cfg.replace(pp=1, schedule="1f1b", memory_limit=None))
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(ref_losses),
                               rtol=1e-5, atol=0)
    info = results[0]["reschedule"]
    assert info["profiled"] == "zb-h1" and info["steps"] == [1, 2]
    assert info["predicted_s"] > 0 and max(info["predicted_peak_bytes"]) <= 1e9
    assert len(info["measured_after_s"]) == 2          # steps 3 and 4 ran the searched schedule


def test_memory_limit_needs_zb_auto_and_enough_steps():
    with pytest.raises(ConfigError, match="memory_limit applies to the zb-auto schedule"):
        TINY.replace(schedule="1f1b", pp=2, microbatches=4, memory_limit=1e9).validate()
    with pytest.raises(ConfigError, match=r"needs steps >= 4"):
        TINY.replace(schedule="zb-auto", pp=2, microbatches=4, steps=3, memory_limit=1e9).validate()
