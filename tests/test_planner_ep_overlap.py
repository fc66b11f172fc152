"""Megatron's EP A2A overlap (``--overlap-moe-expert-parallel-comm``) as a choice the user
makes: ``pipesim simulate`` and ``pipesim plan`` take the flag, the search prices every MoE plan
at ep > 1 with it, and a dense plan or ep 1 is left as without it."""
from __future__ import annotations

import dataclasses
import json

from pipesim.cli import main
from pipesim.planner import SearchSpace, enumerate_plans
from pipesim.plan.model import ModelSpec
from pipesim.sim.plan_report import simulate_plan

MOE = ModelSpec("tiny-moe", layers=4, hidden=256, heads=4, seq_length=256, vocab=1000, experts=4,
                top_k=2, moe_ffn_hidden=512, mlp="swiglu", norm="rmsnorm", position="rotary",
                tied_embeddings=False, bias=False, dropout=False)


def test_the_search_prices_moe_plans_at_ep_above_1_with_the_overlap_and_leaves_the_rest():
    space = SearchSpace(MOE, gpus=4, gbs=8, hardware="H100", mbs=(1,), recompute=("none",),
                        cp=(1,), zero=(1,), schedules=("1f1b",), overlap_ep_comm=True)
    plans = enumerate_plans(space).plans
    assert {p.parallelism.ep for p in plans} == {1, 2, 4}
    for p in plans:
        assert p.parallelism.overlap_ep_comm == (p.parallelism.ep > 1)
    # the same exchange, less of it shown (its closed form: tests/test_plan_cp_ep_costs.py)
    plan = next(p for p in plans if p.parallelism.ep == 4)
    plain = plan.with_(parallelism=dataclasses.replace(plan.parallelism, overlap_ep_comm=False))
    with_overlap, without = plan.derive(), plain.derive()
    assert with_overlap.comm["ep"] == without.comm["ep"] > 0      # the same exchange
    assert simulate_plan(plan).step_time < simulate_plan(plain).step_time
    dense = dataclasses.replace(MOE, name="tiny-dense", experts=0, top_k=0, moe_ffn_hidden=None)
    dense_plans = enumerate_plans(dataclasses.replace(space, model=dense)).plans
    assert not any(p.parallelism.overlap_ep_comm for p in dense_plans)


def test_plan_and_simulate_take_the_flag(tmp_path, capsys):
    best = tmp_path / "best.json"
    assert main(["plan", "--model", "mixtral-8x7b", "--gpus", "16", "--hardware", "H100",
                 "--gbs", "32", "--ep", "8", "--pp", "2", "--tp", "1", "--cp", "1", "--mbs", "1",
                 "--recompute", "full", "--zero", "1", "--schedules", "1f1b",
                 "--ep-dispatcher", "alltoall", "--overlap-moe-expert-parallel-comm",
                 "--no-progress", "--plan-out", str(best)]) == 0
    par = json.loads(best.read_text())["parallelism"]
    assert par["ep"] == 8 and par["overlap_ep_comm"] is True
    capsys.readouterr()
    assert main(["simulate", "--plan", str(best), "--no-overlap-moe-expert-parallel-comm",
                 "--save-plan", str(tmp_path / "again.json")]) == 0
    assert json.loads((tmp_path / "again.json").read_text())["parallelism"]["overlap_ep_comm"] \
        is False
