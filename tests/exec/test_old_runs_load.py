"""A checkpoint and a measured run written before pipeexec's config held a plan still load.

tests/data/old_8ef147e/ was written by the code of commit 8ef147e (its ``expected.json`` holds
the command): a 2-step run of the built-in GPT (3 blocks, hidden 16) on pp 2, saved (``ckpt``)
and profiled (``run.json`` with its ``.csv`` and ``.meta.json``), and the losses of the same run
trained 3 steps straight. Those files store the config flat (``ffn_mult``, no ``plan``) and the
old cut ([1, 2] blocks; today's is pipesim's [2, 1]), which loading must read and reshard.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import pipesim

from pipeexec.analysis.measured_run import MeasuredRun
from pipeexec.analysis.predict import layout_of, predict
from pipeexec.analysis.run_description import inherit
from pipeexec.checkpoint.contents import check_config
from pipeexec.checkpoint.errors import CheckpointError
from pipeexec.checkpoint.convert import config_from_dict
from pipeexec.checkpoint.reader import CheckpointReader
from pipeexec.config import TrainConfig

OLD = Path(__file__).resolve().parents[1] / "data" / "old_8ef147e"
FLAGS = ["--pp", "2", "--microbatches", "2", "--layers", "3", "--hidden", "16", "--heads", "2",
         "--seq-len", "8", "--vocab", "64", "--decay-steps", "3"]
# the same run as today's TrainConfig
SAME = TrainConfig.from_flat(pp=2, microbatches=2, layers=3, hidden=16, heads=2, seq_len=8,
                             vocab=64, decay_steps=3, steps=2)


def test_the_old_checkpoints_config_reads_as_todays():
    reader = CheckpointReader(OLD / "ckpt")
    saved = reader.config
    assert "plan" not in saved and saved["ffn_mult"] == 4          # the old flat form
    config, notes = config_from_dict(saved)
    assert config.to_dict() == SAME.to_dict() and notes == []
    assert config.plan.model.ffn == 64 and config.model.family is None
    # loading compares it with today's run: no model-defining difference, and one is refused
    # (the old ffn_mult read as today's ffn_hidden)
    assert check_config(saved, SAME.with_flat(steps=3).to_dict()) == []
    for field, value in (("hidden", 32), ("ffn_hidden", 32)):
        with pytest.raises(CheckpointError, match=f"{field}=64" if field == "ffn_hidden"
                           else f"{field}=16"):
            check_config(saved, SAME.with_flat(**{field: value}).to_dict())
    assert reader.layout["bounds"] == [0, 2, 5]                    # the old cut


def test_the_old_measured_run_loads_calibrates_and_predicts():
    run = MeasuredRun.load(OLD / "run.json")
    assert run.meta["config"]["ffn_mult"] == 4 and "plan" not in run.meta["config"]
    # compare --calibrate-from reads the run's model from its flat config
    got = inherit(TrainConfig(), set(), run.meta, cpus_per_rank=None, source="run.json")
    model = got.config.plan.model
    assert (model.layers, model.hidden, model.ffn, model.vocab) == (3, 16, 64, 64)
    config = got.config.with_flat(pp=2, microbatches=2)
    layout = layout_of(config)
    assert layout.bounds == (0, 3, 5)            # today's cut, re-partitioned from the old one
    result, _ = predict(config.build_schedule(), layout, run)
    assert result.makespan > 0 and len(result.peak_memory) == 2
    assert pipesim.simulate(config.plan).step_time > 0


@pytest.mark.slow
def test_the_old_checkpoint_resumes_to_the_old_runs_loss(tmp_path):
    """Step 3 resumed from the old checkpoint (resharded into today's cut) has the loss the
    old code's uninterrupted 3-step run had."""
    from pipeexec.cli.main import main

    ckpt = tmp_path / "ckpt"
    shutil.copytree(OLD / "ckpt", ckpt)              # the fixture stays as written
    metrics = tmp_path / "m.json"
    main(["train", *FLAGS, "--steps", "3", "--load", str(ckpt), "--no-progress",
          "--metrics-out", str(metrics)])
    want = json.loads((OLD / "expected.json").read_text())["losses_3_steps"]
    losses = json.loads(metrics.read_text())["losses"]
    assert losses == pytest.approx(want[2:], rel=1e-5)
