"""The planner searches the expert-parallel dispatcher: Megatron's all-to-all, DeepEP and
HybridEP, each where the hardware runs it (`Hardware.ep_dispatchers`), and only where a MoE
plan dispatches (ep > 1); a rated plan that differs in it is told so by name."""
import json

import pytest

from pipesim.cli import main as pipesim_main
from pipesim.errors import PlanError
from pipesim.hardware import EP_DISPATCHERS, Hardware, get_hardware, hardware_names
from pipesim.plan.model import get_model
from pipesim.plan.parallelism import Parallelism
from pipesim.planner import SearchSpace, search
from pipesim.planner.enumerate import enumerate_plans
from pipesim.planner.explain import explain
from pipesim.planner.rate import rate_plan

# one layout but for ep (8 GPUs: tp, cp, pp 1, dp 8; one micro batch size, schedule,
# recomputation and ZeRO level): ep takes every divisor of the 8 experts, each dividing dp
# Mixtral's layers and experts, 4 of its 32 layers (so that 8 or 16 GPUs hold it)
MOE = get_model("mixtral-8x7b").with_(layers=4)
ONE_LAYOUT = dict(tp=(1,), cp=(1,), pp=(1,), mbs=(1,), recompute=("none",), zero=(1,),
                  schedules=("1f1b",))


def _space(model=MOE, hardware="H100", **knobs) -> SearchSpace:
    return SearchSpace(model, gpus=8, gbs=16, hardware=hardware, **{**ONE_LAYOUT, **knobs})


@pytest.mark.parametrize("hardware, dispatchers", [("H100", 3), ("GB200", 2), ("A100", 1)])
def test_each_dispatcher_the_hardware_runs_is_tried_at_ep_above_1_and_one_at_ep_1(
        hardware, dispatchers):
    plans = enumerate_plans(_space(hardware=hardware)).plans
    # ep 1, 2, 4, 8 (the divisors of Mixtral's 8 experts): one plan at ep 1, then one per
    # dispatcher at each of the three others
    assert len(plans) == 1 + dispatchers * 3
    seen = {(p.parallelism.ep, p.parallelism.ep_dispatcher) for p in plans}
    runs = get_hardware(hardware).ep_dispatchers
    assert seen == {(1, "alltoall")} | {(ep, d) for ep in (2, 4, 8) for d in runs}
    assert len({p.parallelism for p in plans}) == len(plans)          # no plan twice


def test_a_dense_model_and_a_narrowed_space_enumerate_one_dispatcher():
    dense = enumerate_plans(_space("llama3-8b")).plans
    assert [p.parallelism.ep_dispatcher for p in dense] == ["alltoall"]
    # given alone, the flex dispatcher is tried at ep > 1; ep 1 keeps the default
    only = enumerate_plans(_space(ep_dispatcher=("hybridep",))).plans
    assert sorted((p.parallelism.ep, p.parallelism.ep_dispatcher) for p in only) == [
        (1, "alltoall"), (2, "hybridep"), (4, "hybridep"), (8, "hybridep")]
    # the whole default space of a dense model: every plan the all-to-all's, none twice
    full = enumerate_plans(SearchSpace("llama3-8b", gpus=16, gbs=32, hardware="H100")).plans
    assert {p.parallelism.ep_dispatcher for p in full} == {"alltoall"}
    assert len(full) == len(enumerate_plans(SearchSpace(
        "llama3-8b", gpus=16, gbs=32, hardware="H100", ep_dispatcher=("alltoall",))).plans)


def test_the_pick_with_the_flex_dispatchers_is_at_least_as_fast_as_with_the_all_to_all_only():
    # Mixtral's layers on two H100 nodes, pp 2: ep up to 8 inside a node, where the flex
    # dispatcher sends a token once to each rank holding some of its experts (not once an
    # expert) and HybridEP permutes inside its kernels
    knobs = dict(tp=(1,), cp=(1,), pp=(2,), mbs=(1,), recompute=("none",), zero=(1,),
                 schedules=("1f1b",))
    every = search(SearchSpace(MOE, gpus=16, gbs=32, hardware="H100", **knobs),
                   workers=1)
    a2a = search(SearchSpace(MOE, gpus=16, gbs=32, hardware="H100",
                             ep_dispatcher=("alltoall",), **knobs), workers=1)
    best, best_a2a = every.ranked.iloc[0], a2a.ranked.iloc[0]
    assert best["step_time"] <= best_a2a["step_time"]
    assert best["ep_dispatcher"] != "alltoall" and best["step_time"] < best_a2a["step_time"]
    # every all-to-all plan is still in the wider search, under the same key
    assert set(a2a.rows["key"]) <= set(every.rows["key"])
    assert best["key"].split()[6] == f"ep{best['ep']}({best['ep_dispatcher']})"
    # the why-table's neighbours include the next dispatcher, named as the knob changed
    changes = list(explain(every)["change"])
    assert any(c.startswith("ep_dispatcher ") for c in changes), changes


def test_a_rated_plan_that_differs_in_the_dispatcher_alone_names_it():
    result = search(_space(), workers=1)
    best = result.best
    assert best.parallelism.ep > 1 and best.parallelism.ep_dispatcher == "hybridep"
    mine = best.with_(ep_dispatcher="alltoall")
    rating = rate_plan(mine, best, result.memory_limit)
    assert [c.knob for c in rating.changes] == ["ep_dispatcher"]
    change = rating.changes[0]
    assert (change.mine, change.best) == ("alltoall", "hybridep")
    # the one change makes the plan the pick: its step time is the pick's
    assert change.step_time == pytest.approx(rating.best_step_time, rel=1e-12)
    assert rating.step_time > rating.best_step_time
    assert "ep_dispatcher alltoall -> hybridep" in rating.text()


def test_the_dispatcher_flag_refuses_bad_values_naming_the_flag_and_the_choices(capsys):
    base = ["plan", "--model", "mixtral-8x7b", "--gpus", "8", "--gbs", "16", "--no-progress"]
    with pytest.raises(SystemExit) as info:             # argparse's usage error
        pipesim_main([*base, "--ep-dispatcher", "alltoall,flex"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--ep-dispatcher" in err and "'flex': choose from alltoall, deepep, hybridep" in err
    # a dispatcher the hardware does not run: refused before any search, saying which it runs
    assert pipesim_main([*base, "--hardware", "GB200", "--ep-dispatcher", "deepep"]) == 2
    err = capsys.readouterr().err
    assert "ep_dispatcher deepep does not run on GB200, which runs alltoall, hybridep" in err
    with pytest.raises(ValueError, match=r"ep_dispatcher \(--ep-dispatcher\) values must be "
                                         r"among alltoall, deepep, hybridep"):
        _space(ep_dispatcher=("nccl",))


def test_every_preset_says_which_dispatchers_it_runs_and_where_that_comes_from():
    for name in hardware_names():
        hw = get_hardware(name)
        assert hw.ep_dispatchers and set(hw.ep_dispatchers) <= set(EP_DISPATCHERS), name
        assert "alltoall" in hw.ep_dispatchers and hw.source("ep_dispatchers"), name
    # NVL72 racks: HybridEP alone of the flex backends supports multi-node NVLink
    assert get_hardware("GB200").ep_dispatchers == ("alltoall", "hybridep")
    assert get_hardware("H100").ep_dispatchers == EP_DISPATCHERS


def test_a_hardware_file_keeps_its_dispatchers_and_older_files_run_the_all_to_all(tmp_path):
    path = tmp_path / "hw.json"
    get_hardware("GB300").save(path)
    assert json.loads(path.read_text())["ep_dispatchers"] == ["alltoall", "hybridep"]
    assert Hardware.load(path).ep_dispatchers == ("alltoall", "hybridep")
    data = json.loads(path.read_text())
    del data["ep_dispatchers"]                           # a file written before the field
    assert Hardware.from_dict(data).ep_dispatchers == ("alltoall",)
    assert "ep_dispatchers" not in Hardware.from_dict(data).to_dict()
    with pytest.raises(ValueError, match="ep_dispatchers must list each of the dispatchers"):
        Hardware.from_dict({**data, "ep_dispatchers": ["alltoall", "flex"]})
    with pytest.raises(PlanError, match="parallelism.ep_dispatcher: 'flex' is not one of"):
        Parallelism(ep_dispatcher="flex")
