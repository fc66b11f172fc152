"""Defaults find plans for every preset model (`pipesim models`) on power-of-two clusters.

Each preset is planned on H100s at the smallest power of two whose GPUs hold its weights,
gradients and optimizer state, sharded over all of them, in nine tenths of the usable memory
(the last tenth for activations and buffers; at the bare minimum Llama 3 8B on 2 GPUs and
Llama 2 70B on 16 are rightly left without a plan: their state alone fills the GPUs). The
whole default search runs for the presets it takes seconds on (dense and MoE: Qwen1.5-MoE);
for the others (Qwen3 30B-A3B, Mixtral, the large dense ones, Qwen3-235B, GPT-OSS 120B,
DeepSeek-V3, Kimi K2: 10 s to minutes each) the fast tier shows that the default space holds
a plan that fits (the search finds the best one: pruning never drops it,
tests/test_planner.py).
"""
from __future__ import annotations

import dataclasses

import pytest

from pipesim.cli import build_parser
from pipesim.cli.planner_cmds import space_from_args
from pipesim.hardware import get_hardware
from pipesim.plan.model import PRESETS
from pipesim.sim.plan_report import simulate_plan
from pipesim.planner import SearchSpace, enumerate_plans, plan_bounds, search

H100 = get_hardware("H100")
# Megatron's bytes per parameter in bf16 with fp32 gradients: weights 2, gradients 4, Adam's
# two moments and the fp32 master 12
STATE_BYTES = 18
# presets whose whole default search takes more than a few seconds at their size
SLOW = ("qwen3-30b-a3b", "mixtral-8x7b", "llama2-70b", "llama3-70b", "gpt3-175b",
        "llama3-405b", "qwen3-235b-a22b", "gpt-oss-120b", "deepseek-v3", "kimi-k2")


def cluster_size(name: str) -> int:
    """The smallest power of two of H100s holding the model's state in 0.9 of their memory."""
    need = STATE_BYTES * PRESETS[name].num_params() / (0.9 * H100.usable_memory)
    n = 1
    while n < need:
        n *= 2
    return n


def default_space(name: str) -> SearchSpace:
    """The preset on its cluster at gbs 2 per GPU (16 at least), every knob at its default."""
    n = cluster_size(name)
    return SearchSpace(PRESETS[name], n, max(16, 2 * n), hardware=H100)


@pytest.mark.parametrize("name", list(PRESETS))
def test_the_command_lines_defaults_are_the_librarys(name):
    space = default_space(name)
    args = build_parser().parse_args(["plan", "--model", name, "--gpus", str(space.gpus),
                                      "--gbs", str(space.gbs)])
    assert space_from_args(args) == space


@pytest.mark.parametrize("name", [n for n in PRESETS if n not in SLOW])
def test_the_default_search_finds_a_plan(name):
    space = default_space(name)
    result = search(space, workers=1)
    best = result.best
    assert best is not None, result.closest(3)[["key", "reason"]].to_string()
    assert best.world_size == space.gpus
    # the plan, simulated again apart from the search, fits the GPU's usable memory
    assert max(simulate_plan(best).peak_memory) <= H100.usable_memory


@pytest.mark.parametrize("name", SLOW)
def test_the_default_space_of_a_large_preset_holds_a_plan_that_fits(name):
    """The fast tier's check for the presets whose whole search is slow: among the default
    space's 1F1B plans with the memory-lean knobs (full recomputation, micro batch 1, ZeRO-3
    where dp * cp shards it), in order of their memory bound, one fits when simulated. (1F1B's
    plans are enumerated alone: a schedule's plans do not depend on the others', and the
    builders' checks of the others take seconds on these models.)"""
    space = dataclasses.replace(default_space(name), schedules=("1f1b",))
    lean = [p for p in enumerate_plans(space).plans
            if p.parallelism.recompute == "full"
            and p.parallelism.micro_batch_size == 1
            and p.parallelism.zero == (3 if p.parallelism.dp * p.parallelism.cp > 1 else 0)]
    assert lean
    by_bound = sorted(lean, key=lambda p: plan_bounds(p, exact_order=False).memory)
    fits = None
    for plan in by_bound[:5]:
        if max(simulate_plan(plan).peak_memory) <= H100.usable_memory:
            fits = plan
            break
    assert fits is not None, f"none of the {len(by_bound[:5])} leanest plans fits"
