"""The planner's defaults find plans where layers do not divide (issue 25: Llama 3 405B on
16384 H100s found none), and a search that fits nothing names every knob that would widen it."""
import pytest

from pipesim.plan.model import PRESETS
from pipesim.planner.enumerate import SearchSpace, enumerate_plans
from pipesim.planner.hints import fit_hints


def test_405b_defaults_enumerate_uneven_stages_and_every_zero_stage():
    space = SearchSpace(PRESETS["llama3-405b"], 16384, 2048, seq_length=8192,
                        schedules=("1f1b", "interleaved"), mbs=(1,), recompute=("none",))
    enum = enumerate_plans(space)
    pps = {p.parallelism.pp for p in enum.plans}
    assert any(126 % (p.parallelism.pp * p.parallelism.vpp) for p in enum.plans)
    assert {8, 16, 32} <= pps                          # 126 layers divide none of them
    assert {p.parallelism.zero for p in enum.plans} == {0, 1, 2, 3}
    uneven = next(p for p in enum.plans if p.parallelism.pp == 16 and p.parallelism.vpp == 1)
    layers = uneven.stage_layers()
    assert sum(layers) == 126 and max(layers) - min(layers) <= 1
    even_only = enumerate_plans(SearchSpace(PRESETS["llama3-405b"], 16384, 2048, seq_length=8192,
                                            schedules=("1f1b",), mbs=(1,), recompute=("none",),
                                            uneven=False))
    assert {p.parallelism.pp for p in even_only.plans} <= {1, 2}


def test_the_hint_names_each_narrowed_knob_and_only_those():
    narrow = SearchSpace(PRESETS["llama3-8b"], 8, 16, zero=(0, 1), recompute=("none",),
                         mbs=(2, 4), uneven=False, tp=(1, 2))
    hints = " | ".join(fit_hints(narrow))
    for flag in ("--zero 0,1,2,3", "--recompute full", "--mbs 1", "--uneven", "--tp ",
                 "--tp-across-nodes", "--memory-limit"):
        assert flag in hints, flag
    wide = " | ".join(fit_hints(SearchSpace(PRESETS["llama3-8b"], 8, 16)))
    for flag in ("--zero", "--recompute", "--mbs", "--uneven", "--tp "):
        assert flag not in wide, flag


@pytest.mark.slow
def test_pipesim_plan_405b_on_16384_h100_finds_a_plan_with_its_defaults(capsys):
    """The issue's command, as given (a few minutes)."""
    from pipesim.cli import main

    code = main(["plan", "--model", "llama3-405b", "--gpus", "16384", "--hardware", "H100",
                 "--gbs", "2048", "--seq", "8192", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out[-2000:]
    assert "nothing fits" not in out
