"""Profile, re-schedule, run: `--schedule zb-auto --memory-limit X` profiles a split-backward
schedule (ZB-H1; at vpp 2 ZB-V, or interleaved with I and W apart), searches zb-auto from the
measured costs in the same placement, switches every rank to it, and trains on: the losses stay
those of single-process training (any valid schedule computes the same step)."""
import pytest
import torch

import pipesim
from pipesim.schedule.io import schedule_from_dict

from pipeexec import launch
from pipeexec.config import ConfigError
from pipeexec.run.worker import WorkerArgs, run_training

from exec_helpers import TINY, reference_train

pytestmark = pytest.mark.slow


def worker(board, config):
    metrics = run_training(board, WorkerArgs(config, progress=False)).metrics
    return {"losses": metrics["losses"], "reschedule": metrics.get("reschedule")}


@pytest.mark.parametrize("vpp, placement, profiled", [
    (1, None, "zb-h1"), (2, None, "zbv"), (2, "looped", "interleaved (I+W)")])
def test_zb_auto_from_the_runs_own_costs_trains_like_a_single_process(vpp, placement, profiled):
    cfg = TINY.with_flat(schedule="zb-auto", pp=2, vpp=vpp, placement=placement, microbatches=4,
                         micro_batch_size=2, steps=6, memory_limit=1e9, reschedule_after=2,
                         layers=2 * vpp)
    results = launch(worker, 2, (cfg,), timeout=300)
    ref_losses, _, _ = reference_train(cfg.with_flat(pp=1, vpp=1, schedule="1f1b", placement=None,
                                                     memory_limit=None))
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(ref_losses),
                               rtol=1e-5, atol=0)
    info = results[0]["reschedule"]
    assert info["profiled"] == profiled and info["steps"] == [2, 3]    # after 2 warm-up steps
    assert info["predicted_s"] > 0 and max(info["predicted_peak_bytes"]) <= 1e9
    assert len(info["measured_after_s"]) == 2          # steps 4 and 5 ran after the switch:
    assert info["trial"]["steps"] == 1                 # 4 the searched order, 5 the replaced
    assert info["margin"] == 0.05                      # the default: a hand-made order kept
    assert info["handcrafted"] in (None, "zb-h1", "1f1b", "zb-h2", "zbv", "interleaved",
                                   "v-half", "v-min", "dualpipev")
    searched = schedule_from_dict(info["schedule"])           # what ran after the switch
    assert searched.name == "zb-auto" and searched.parts_per_rank == vpp == info["vpp"]
    assert searched.placement_kind == info["placement"] == (
        "v" if vpp == 2 and placement is None else "looped")


def test_profiled_looped_schedule_is_interleaved_with_its_backward_split():
    """Same order and memory as interleaved 1F1B; only each B's halves are timed apart."""
    from pipesim import CostModel, simulate
    from pipeexec.measuring.reschedule import profiled_schedule

    cfg = TINY.with_flat(schedule="zb-auto", pp=4, vpp=2, placement="looped", microbatches=8,
                         steps=5, memory_limit=1e9, layers=8)
    split = profiled_schedule(cfg)
    base = pipesim.build_schedule("interleaved", pp=4, vpp=2, microbatches=8)
    for r in range(4):
        joined = [a for a in split.compute_order(r) if a.op != "W"]
        assert [(a.stage, a.microbatch) for a in joined] == \
            [(a.stage, a.microbatch) for a in base.compute_order(r)]
        assert [a.op for a in joined] == ["I" if a.op == "B" else a.op
                                          for a in base.compute_order(r)]
    costs = CostModel.uniform(1.0, 2.0, activation_bytes=1.0)   # W frees what B would have
    assert simulate(split, costs).peak_memory == simulate(base, costs).peak_memory


def test_placement_needs_zb_auto_at_vpp_2():
    with pytest.raises(ConfigError, match="placement chooses where zb-auto"):
        TINY.with_flat(schedule="zbv", pp=2, vpp=2, microbatches=4, placement="v").validate()
    with pytest.raises(ConfigError, match="placement chooses where zb-auto"):
        TINY.with_flat(schedule="zb-auto", pp=2, microbatches=4, placement="looped").validate()
    with pytest.raises(ConfigError, match="placement must be one of looped, v"):
        TINY.with_flat(schedule="zb-auto", pp=2, vpp=2, microbatches=4, layers=4,
                       placement="zigzag").validate()
    with pytest.raises(ConfigError, match="vpp = 1 or 2 and a backward, got vpp = 3"):
        TINY.with_flat(schedule="zb-auto", pp=2, vpp=3, microbatches=4, layers=6, steps=5,
                       memory_limit=1e9).validate()
    for bad in (-0.1, 1.0, True, "5%"):
        with pytest.raises(ConfigError, match="reschedule_margin must be a fraction"):
            TINY.with_flat(schedule="zb-auto", pp=2, microbatches=4, steps=5, memory_limit=1e9,
                           reschedule_margin=bad).validate()
    s = TINY.with_flat(schedule="zb-auto", pp=2, vpp=2, microbatches=4, layers=4,
                       placement="looped").build_schedule()
    assert s.placement_kind == "looped"


def test_memory_limit_needs_zb_auto_and_enough_steps():
    with pytest.raises(ConfigError, match="memory_limit applies to the zb-auto schedule"):
        TINY.with_flat(schedule="1f1b", pp=2, microbatches=4, memory_limit=1e9).validate()
    with pytest.raises(ConfigError, match=r"profiles steps 2..3 \(after 2 warm-up steps\).*"
                                          r"needs steps >= 5"):
        TINY.with_flat(schedule="zb-auto", pp=2, microbatches=4, steps=4,
                       memory_limit=1e9).validate()


def test_a_searched_order_measured_slower_is_switched_back():
    """margin 0.99: nothing is measured 99% faster, so after its trial steps (4, 5) and the
    replaced order's again (6, 7) the run stays on the profiled order, every rank alike; the
    losses stay those of single-process training through the switches, and the log's figures
    are recorded."""
    cfg = TINY.with_flat(schedule="zb-auto", pp=2, microbatches=4, micro_batch_size=2, steps=9,
                         memory_limit=1e9, reschedule_after=2, reschedule_margin=0.99)
    results = launch(worker, 2, (cfg,), timeout=300)
    ref_losses, _, _ = reference_train(cfg.with_flat(pp=1, schedule="1f1b", memory_limit=None))
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(ref_losses),
                               rtol=1e-5, atol=0)
    info = results[0]["reschedule"]
    trial = info["trial"]
    assert trial["steps"] == 2 and trial["kept"] is False and trial["reverted_to"] == "zb-h1"
    assert trial["before_s"] > 0 and trial["measured_s"] > 0 and trial["margin"] == 0.99
    assert trial["margin_reference"] in ("1f1b", "zb-h1", "zb-h2")
    assert info["final_schedule"] == "zb-h1"
    assert results[1]["reschedule"]["final_schedule"] == "zb-h1"      # every rank switched back


def test_a_limit_below_one_microbatch_is_refused_before_step_0():
    from pipeexec import WorkerFailed

    cfg = TINY.with_flat(schedule="zb-auto", pp=2, microbatches=4, micro_batch_size=2, steps=5,
                         memory_limit=100.0, reschedule_after=2)
    with pytest.raises(ConfigError) as info:          # by the config, before any process
        cfg.validate()
    text = str(info.value)
    assert "100 bytes is below what one microbatch needs" in text
    assert "at least 1024 bytes" in text              # 2 x 8 x 16 fp32 values
    with pytest.raises(WorkerFailed) as info:         # and by every rank, launched directly
        launch(worker, 2, (cfg,), timeout=120)
    assert "100 bytes is below what" in str(info.value)


def test_zb_auto_under_zero3_searches_with_its_actions_and_trains_like_a_single_process():
    """pp 2 x dp 2 with ZeRO-3: the profiled ZB-H1 ran lowered (gathers, reductions), the search
    ranks its candidates lowered the same (the record names the sharding), and the switches
    keep single-process training's losses (the predicted figure itself against the simulator:
    test_reschedule_rule.py)."""
    cfg = TINY.with_flat(schedule="zb-auto", pp=2, dp=2, zero=3, microbatches=4,
                         micro_batch_size=1, steps=6, memory_limit=1e9, reschedule_after=2)
    results = launch(worker, 4, (cfg,), timeout=300)
    ref_losses, _, _ = reference_train(cfg.with_flat(pp=1, dp=1, zero=0, schedule="1f1b",
                                                     micro_batch_size=2, memory_limit=None))
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(ref_losses),
                               rtol=1e-5, atol=0)
    info = results[0]["reschedule"]
    assert info["sharding"] == {"zero": 3, "grad_reduce": "per_step"}
    assert info["profiled"] == "zb-h1" and info["predicted_s"] > 0
    assert schedule_from_dict(info["schedule"]).sharding is None    # the Trainer lowers it
