"""`TrainConfig` in sections by concern, and the CLI generated from its fields."""
from __future__ import annotations

import dataclasses
import pickle

import pytest

from pipeexec.cli.train import config_from_args, train_parser
from pipeexec.config import (DEFAULT_PLAN, PLAN_VIEWS, SECTIONS, DataConfig, LayoutConfig,
                             OptimizerConfig, PrecisionConfig, RuntimeConfig, TrainConfig)


def test_sections_hold_every_field_once_and_read_flat():
    names = [f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)]
    names += PLAN_VIEWS                       # the plan's facts, stored in the plan alone
    assert len(names) == len(set(names)) == len(TrainConfig.field_names())
    c = TrainConfig.from_flat(pp=2, layers=4, lr=3e-4, precision="bf16", seed=5)
    assert (c.plan.parallelism.pp, c.plan.model.layers, c.optimizer.lr,
            c.plan.parallelism.precision, c.runtime.seed) == (2, 4, 3e-4, "bf16", 5)
    flat = c.to_flat()                        # the flat names, at the edge that spells them
    assert (flat["pp"], flat["layers"], flat["lr"], flat["precision"], flat["seed"]) == (
        2, 4, 3e-4, "bf16", 5)
    plan = DEFAULT_PLAN.with_(pp=2, precision="bf16").with_(
        model=DEFAULT_PLAN.model.with_(layers=4))
    same = TrainConfig(plan=plan, layout=LayoutConfig(), inputs=DataConfig(),
                       optimizer=OptimizerConfig(lr=3e-4), mixed_precision=PrecisionConfig(),
                       runtime=RuntimeConfig(seed=5))
    assert same == c and hash(same) == hash(c)
    assert c.with_flat(pp=4).plan == plan.with_(pp=4)
    assert c.replace(plan=DEFAULT_PLAN).plan.model.layers == DEFAULT_PLAN.model.layers
    assert TrainConfig.from_dict(c.to_dict()) == c == pickle.loads(pickle.dumps(c))
    with pytest.raises(TypeError, match="unknown field 'pipeline'"):
        TrainConfig.from_flat(pipeline=2)
    with pytest.raises(AttributeError, match="no attribute 'pipeline'"):
        c.pipeline


def test_every_field_has_a_flag_whose_default_is_the_fields():
    parser = train_parser()
    assert config_from_args(parser.parse_args([])) == TrainConfig()
    flags = {o for a in parser._actions for o in a.option_strings}
    for name in TrainConfig.field_names():
        assert TrainConfig.flag(name) in flags, name
    # each flag reaches its field
    argv = ["--ffn-hidden", "128", "--beta2", "0.9", "--no-deallocate-outputs",
            "--cpu-return-freed-memory", "--boundaries", "2,3", "--memory-limit", "2GB",
            "--schedule", "zb-auto", "--collective-timeout", "30"]
    c = config_from_args(parser.parse_args(argv))
    assert (c.plan.model.ffn, c.optimizer.beta2, c.runtime.deallocate_outputs,
            c.runtime.cpu_keep_freed_memory, c.layout.boundaries, c.layout.memory_limit,
            c.runtime.collective_timeout) == (128, 0.9, False, False, (2, 3), 2e9, 30.0)


def test_checkpoint_flags_are_generated_from_checkpoint_options(monkeypatch):
    from pipeexec.checkpoint import FAULT_ENV, CheckpointOptions
    from pipeexec.cli.checkpoint import options_from_args

    monkeypatch.delenv(FAULT_ENV, raising=False)
    parser = train_parser()
    assert options_from_args(parser.parse_args([])) == CheckpointOptions()
    ns = parser.parse_args(["--save", "d", "--save-interval", "2", "--keep-last", "3",
                            "--load", "e", "--ckpt-step", "4", "--no-load-rng",
                            "--checkpoint-timeout", "9"])
    assert options_from_args(ns) == CheckpointOptions(save="d", save_interval=2, keep_last=3,
                                                      load="e", ckpt_step=4, no_load_rng=True,
                                                      timeout=9.0)
