"""Fast (2 ranks, a step or a few) versions of what only slow tests covered, so that
``-m "not slow"`` catches a bug there:

* tensor parallelism's all-reduces (row-parallel outputs, column-parallel input gradients,
  sequence parallelism's gather / reduce-scatter and its replicated weights' gradients): tp 2
  trains as one process (losses, parameters, gradient norms);
* resharding a checkpoint into another placement (1F1B's pp 2 into ZB-V's V at vpp 2, and
  interleaved's looped vpp 2): the stages' layers reordered by global name, so the next step
  is the one-process reference's second step;
* resharding between tensor-parallel sizes: a tp 1 checkpoint loaded at tp 2 holds, put back
  together in rank order, exactly the saved weights and AdamW moments;
* loading each expert-parallel rank's slice of the experts: an ep 1 checkpoint loaded at ep 2
  holds exactly the saved experts and AdamW moments, put back together.
"""
from __future__ import annotations

import pytest
import torch

from pipeexec import launch

from pipeexec.checkpoint import CheckpointManager, CheckpointOptions
from pipeexec.topology import destroy_topology, init_topology
from pipeexec.training.train import train
from pipeexec.run.assemble import assemble

from exec_helpers import TINY, reference_run
from test_tensor_parallel import _run_cases, check

TP_CASES = (("1f1b", ()), ("1f1b", (("sequence_parallel", True),)))


@pytest.mark.parametrize("case", TP_CASES, ids=["tp2", "tp2-sequence-parallel"])
def test_tp2_equals_one_process(case):
    results = _run_cases(2, 1, 1, TP_CASES)          # one launch runs both
    check(results, case, 2)


def checkpoint_worker(board, cfg, options: CheckpointOptions) -> dict:
    """One rank: load, train, save per ``options``; its losses and final parameters."""
    topo = init_topology(cfg.plan.parallelism.pp, cfg.plan.parallelism.dp, timeout=120)
    try:
        trainer = assemble(cfg, topo, board=board)
        manager = CheckpointManager(options)
        manager.load(trainer)
        start = trainer.iteration
        res = train(trainer, on_step=manager.on_step)
        manager.finish(trainer)
        return {"losses": res.losses, "start": start, "pp_rank": topo.pp_rank,
                "params": {n: p.detach().clone() for n, p in trainer.named_parameters().items()},
                "resharded": None if manager.loaded is None else manager.loaded.resharded}
    finally:
        destroy_topology(topo)


def _run(cfg, options):
    return launch(checkpoint_worker, cfg.world_size, (cfg, options), timeout=300)


@pytest.mark.parametrize("schedule", ["zbv", "interleaved"])
def test_a_checkpoint_reshards_into_another_placement(tmp_path, schedule):
    base = TINY.with_flat(microbatches=4, micro_batch_size=2, decay_steps=2)
    first = _run(base.with_flat(schedule="1f1b", pp=2, vpp=1, steps=1),
                 CheckpointOptions(save=str(tmp_path / "a")))
    second = _run(base.with_flat(schedule=schedule, pp=2, vpp=2, steps=2),
                  CheckpointOptions(load=str(tmp_path / "a")))
    assert second[0]["resharded"] and second[0]["start"] == 1
    ref = reference_run(base.with_flat(steps=2))
    last = next(r for r in second if r["pp_rank"] == 0)
    torch.testing.assert_close(torch.tensor(first[0]["losses"] + last["losses"]),
                               torch.tensor(ref.losses), rtol=1e-5, atol=0)
    got = {n: p for r in second for n, p in r["params"].items()}
    assert got.keys() == ref.params.keys()
    for n, p in ref.params.items():
        torch.testing.assert_close(got[n], p, rtol=1e-5, atol=1e-6, msg=n)


def test_an_ep_1_checkpoint_loads_each_ep_ranks_slice_of_the_experts(tmp_path):
    pytest.importorskip("transformers")
    from test_expert_parallel import MIXTRAL
    from test_expert_parallel_checkpoint import run, whole
    from test_hf_models import write_model

    directory = str(write_model(tmp_path / "mixtral", MIXTRAL))
    saved = str(tmp_path / "ep1")
    before = run(directory, 1, 1, None, saved)
    after = run(directory, 2, 1, saved)          # loaded, nothing left to train
    for what, loaded in (("params", "loaded"), ("moments", "loaded_moments")):
        want, got = whole(before, what, 1), whole(after, loaded, 2)
        assert want.keys() == got.keys() and any("experts" in n for n in want)
        for n in want:
            assert torch.equal(want[n], got[n]), f"{what} of {n}"


def tp_checkpoint_worker(board, tp: int, load: str | None, save: str | None) -> dict:
    """pp 1 at ``tp``: load (nothing trained after), or train one step and save."""
    from pipeexec.checkpoint.load import load_checkpoint
    from pipeexec.checkpoint.save import save_checkpoint
    from pipeexec.parallel.sharding import shard_spec

    from exec_helpers import layout_config

    cfg = layout_config("1f1b", 1, 1, tp=tp, sequence_parallel=tp > 1, steps=1)
    topo = init_topology(1, 1, tp=tp, device="cpu", timeout=120)
    try:
        trainer = assemble(cfg, topo, board=board)
        if load:
            load_checkpoint(trainer, load)
        else:
            train(trainer)
            save_checkpoint(trainer, save)
        return {"tp_rank": topo.tp_rank,
                "specs": {n: shard_spec(p) for st in trainer.stages.values()
                          for n, p in st.named_parameters()},
                "params": {n: p.detach().clone() for n, p in trainer.named_parameters().items()},
                "moments": {n: st["exp_avg"].clone() for n, st in trainer.full_state()[1].items()}}
    finally:
        destroy_topology(topo)


def test_a_tp_1_checkpoint_reshards_into_tp_2_exactly(tmp_path):
    from test_tensor_parallel_checkpoint import whole

    saved = str(tmp_path / "tp1")
    before = launch(tp_checkpoint_worker, 1, (1, None, saved), timeout=120)
    after = launch(tp_checkpoint_worker, 2, (2, saved, None), timeout=120)
    for what in ("params", "moments"):
        want, got = whole(before, what), whole(after, what)
        assert want.keys() == got.keys() and len(want) > 10
        for n in want:
            assert torch.equal(want[n], got[n]), f"{what} of {n}"
