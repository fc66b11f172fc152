"""A plan that ``pipesim simulate --save-plan`` or ``pipesim plan --plan-out`` writes runs with
``pipeexec train --plan P`` and ``pipeexec compare --plan P`` and nothing else, for the built-in
GPT and each Hugging Face family (tiny configs written here), and what runs is the plan: its
layout, batch and model.

The fast tests check the configuration and the built model against pipesim's own numbers
(parameter counts from `ModelSpec`, the cut from `Plan.stage_layers`); the slow ones run both
commands in forked gloo workers (2 ranks, 2 or 3 steps) and read back what ran from the
metrics and the measured run.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import pipesim  # noqa: E402
from pipesim.cli import main as pipesim_main  # noqa: E402

from pipeexec.cli.train import config_from_args, train_parser  # noqa: E402
from pipeexec.config import ConfigError, TrainConfig  # noqa: E402
from pipeexec.models import layer_stack  # noqa: E402

_DECODER = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=4, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=32, max_position_embeddings=64,
                bos_token_id=1, eos_token_id=2)
CONFIGS = {
    "llama": dict(model_type="llama", **_DECODER),
    "qwen2": dict(model_type="qwen2", **_DECODER),
    "mixtral": dict(model_type="mixtral", **_DECODER, num_local_experts=2,
                    num_experts_per_tok=1),
    "gpt2": dict(model_type="gpt2", n_embd=16, n_layer=4, n_head=2, vocab_size=32,
                 n_positions=16, bos_token_id=1, eos_token_id=2),
}
FAMILIES = ("gpt", *CONFIGS)
# the layout every plan here asks for: 2 pipeline ranks, 4 microbatches of 2 sequences of 8
LAYOUT = ["--pp", "2", "--microbatches", "4", "--micro-batch-size", "2", "--seq-len", "8"]


def write_config(directory: Path, family: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(CONFIGS[family]))
    return directory / "config.json"


def simulate_plan(tmp: Path, family: str) -> Path:
    """The plan ``pipesim simulate --save-plan`` writes: the built-in GPT's from a plan file
    of its shape (pipesim has no preset of it), a family's from its config.json."""
    out = tmp / f"{family}-simulate.json"
    if family == "gpt":
        base = tmp / "gpt-base.json"
        TrainConfig.from_flat(layers=3, hidden=16, heads=2, vocab=32,
                              precision="fp32").plan.to_json(base)
        argv = ["simulate", "--plan", str(base), *LAYOUT]
    else:
        argv = ["simulate", "1f1b", "--model", str(write_config(tmp / family, family)), *LAYOUT,
                "--precision", "fp32"]
    assert pipesim_main([*argv, "--save-plan", str(out)]) == 0
    return out


def searched_plan(tmp: Path, family: str) -> Path:
    """The plan ``pipesim plan --plan-out`` picks for 2 GPUs among what pipeexec runs (its
    filters: no tp, cp, ep or ZeRO)."""
    out = tmp / f"{family}-plan.json"
    config = write_config(tmp / family, family)
    assert pipesim_main(["plan", "--model", str(config), "--gpus", "2", "--pp", "2", "--tp", "1",
                         "--cp", "1", "--ep", "1", "--zero", "0", "--micro-batch-size", "2",
                         "--global-batch-size", "8", "--seq-len", "8", "--precision", "fp32",
                         "--schedules", "1f1b,gpipe", "--no-progress",
                         "--plan-out", str(out)]) == 0
    return out


def plan_files(tmp: Path, family: str) -> list[Path]:
    return [simulate_plan(tmp, family)] + ([] if family == "gpt" else [searched_plan(tmp, family)])


def blocks_bounds(plan: pipesim.Plan) -> list[int]:
    """The layer-list cut of ``plan``: pipesim's blocks per stage, the embedding on the first
    stage, the head on the last (computed here, not by pipeexec)."""
    blocks = plan.stage_layers()
    sizes = [n + (s == 0) + (s == len(blocks) - 1) for s, n in enumerate(blocks)]
    return [sum(sizes[:s]) for s in range(len(sizes) + 1)]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_saved_plan_is_the_run_and_builds_the_plans_model(tmp_path, family):
    for path in plan_files(tmp_path, family):
        plan = pipesim.Plan.from_json(path)
        config = config_from_args(train_parser().parse_args(["--plan", str(path)])).validate()
        assert config.plan == plan and config.model.family == plan.model.family
        par = config.plan.parallelism
        assert (par.pp, par.dp, config.plan.microbatches, par.micro_batch_size,
                par.precision) == (2, 1, 4, 2, "fp32")
        stack = layer_stack(config)
        # pipesim counts the vocabulary padded (Megatron's tables); pipeexec's are unpadded
        want = plan.model.with_(vocab_divisible_by=1).num_params()
        tied = len(stack.tied) * plan.model.vocab * plan.model.hidden
        assert sum(stack.layer_param_counts()) - tied == want, (family, path.name)
        assert stack.num_layers == plan.model.layers + 2
        from pipeexec.analysis.predict import layout_of
        assert list(layout_of(config, stack).bounds) == blocks_bounds(plan)


def test_a_plan_cut_unevenly_splits_as_pipesim_does():
    """7 blocks on 2 stages: pipesim's [4, 3] in both halves (once [4, 3] and [3, 4])."""
    from pipeexec.partition import plan_bounds
    from pipesim.plan.transformer import split_layers

    config = TrainConfig.from_flat(pp=2, layers=7)
    assert config.plan.stage_layers() == split_layers(7, 2) == [4, 3]
    assert plan_bounds(config.plan) == (0, 5, 9)     # embedding + 4 blocks | 3 blocks + head


def test_a_plan_without_its_family_config_is_refused_with_the_reason(tmp_path):
    """A family pipeexec does not build, and a shape its family cannot have, are refused
    naming the field before anything is built."""
    path = simulate_plan(tmp_path, "llama")
    plan = pipesim.Plan.from_json(path)
    with pytest.raises(ConfigError, match=r"model.family = 'qwen3': pipeexec builds"):
        TrainConfig(plan=plan.with_(model=plan.model.with_(family="qwen3"))).validate()
    with pytest.raises(ConfigError, match=r"model.norm = 'layernorm': a llama model"):
        TrainConfig(plan=plan.with_(model=plan.model.with_(norm="layernorm"))).validate()
    # a shape changed after the config was read is the one built (the config follows it)
    deeper = TrainConfig(plan=plan.with_(model=plan.model.with_(layers=4))).validate()
    assert layer_stack(deeper).num_layers == 6


def _ran(tmp: Path, command: str, path: Path, family: str) -> tuple[dict, dict]:
    """Run ``pipeexec COMMAND --plan PATH`` in-process (its workers forked); the recorded
    config and the measured run's meta."""
    from pipeexec.cli.compare import compare_main
    from pipeexec.cli.main import main

    trace = tmp / f"{family}-{command}-trace.json"
    if command == "train":
        metrics = tmp / f"{family}-metrics.json"
        main(["train", "--plan", str(path), "--steps", "2", "--no-progress", "--profile", "1",
              "--trace-out", str(trace), "--metrics-out", str(metrics)])
        recorded = json.loads(metrics.read_text())["config"]
    else:
        assert compare_main(["--plan", str(path), "--steps", "3", "--profile", "1:3",
                             "--trace-out", str(trace),
                             "--report-out", str(tmp / f"{family}-report.json")]) == 0
        recorded = None
    meta = json.loads(trace.with_suffix(".meta.json").read_text())
    return recorded or meta["config"], meta


@pytest.mark.slow
@pytest.mark.parametrize("family", ("gpt", "llama", "qwen2", "mixtral", "gpt2"))
def test_train_and_compare_run_the_plan_as_saved(tmp_path, family):
    """Both commands, the plan file alone: the run's layout, batch and model are the plan's
    (train on the plan ``pipesim simulate`` saved, compare on the one ``pipesim plan`` chose;
    the built-in GPT has only the first, and runs both)."""
    paths = plan_files(tmp_path, family)
    for command, path in (("train", paths[0]), ("compare", paths[-1])):
        plan = pipesim.Plan.from_json(path)
        recorded, meta = _ran(tmp_path, command, path, family)
        ran = pipesim.Plan.from_dict(recorded["plan"])
        assert ran == plan, (command, family)
        assert (ran.model.family, ran.model.hf_config) == (plan.model.family, plan.model.hf_config)
        par = plan.parallelism
        assert (meta["pp"], meta["vpp"], meta["dp"], meta["microbatches"]) == \
            (par.pp, par.vpp, par.dp, par.microbatches), command
        assert (recorded["micro_batch_size"], recorded["seq_len"], recorded["precision"]) == \
            (par.micro_batch_size, plan.model.seq_length, par.precision)
        assert list(meta["bounds"]) == blocks_bounds(plan), command
        assert meta["layer_kinds"][0] == "embedding" and meta["layer_kinds"][-1] == "head"
