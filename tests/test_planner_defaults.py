"""The planner's defaults find plans where layers do not divide (Llama 3 405B on 16384 H100s
once found none: 126 layers divide no power-of-two pp > 2), and a search that fits nothing names
every knob that would widen it."""
import dataclasses

import pytest

from pipesim.plan.model import PRESETS
from pipesim.planner.enumerate import SearchSpace, enumerate_plans
from pipesim.planner.hints import narrowed_hints


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
    narrow = SearchSpace(PRESETS["llama3-8b"], 16, 32, zero=(0, 1), recompute=("none",),
                         mbs=(2, 4), uneven=False, tp=(1, 2))
    hints = " | ".join(narrowed_hints(narrow))
    for flag in ("--zero 0,1,2,3", "--recompute full", "--mbs 1", "--uneven", "--tp ",
                 "--tp-across-nodes"):
        assert flag in hints, flag
    wide = " | ".join(narrowed_hints(SearchSpace(PRESETS["llama3-8b"], 16, 32)))
    for flag in ("--zero", "--recompute", "--mbs", "--uneven", "--tp "):
        assert flag not in wide, flag
    # on one NVLink domain tp already reaches every GPU: across nodes would add nothing
    one_node = dataclasses.replace(narrow, gpus=8, gbs=16)
    assert "--tp-across-nodes" not in " | ".join(narrowed_hints(one_node))


def test_the_405b_default_space_on_16384_h100_holds_the_plan_docs_planning_reports():
    """The whole default search docs/planning.md reports (minutes) picks zbv tp4 cp4 pp32
    vpp2 dp32 mbs1 on uneven stages (126 layers over 64); the search held to that layout, its
    memory knobs at their defaults, finds it again and it fits. Pruning never drops the best
    plan (tests/test_planner.py), so the whole search finds a plan too; a whole default search
    runs in tests/test_readme.py (the README's Llama 3 70B line)."""
    from pipesim.hardware import get_hardware
    from pipesim.sim.plan_report import simulate_plan
    from pipesim.planner.search import search

    space = SearchSpace(PRESETS["llama3-405b"], 16384, 2048, seq_length=8192,
                        schedules=("zbv",), tp=(4,), cp=(4,), pp=(32,), vpp=(2,), mbs=(1,))
    best = search(space, workers=1).best
    assert best is not None
    par = best.parallelism
    assert (par.tp, par.cp, par.pp, par.vpp, par.dp) == (4, 4, 32, 2, 32)
    layers = best.stage_layers()
    assert sum(layers) == 126 and max(layers) - min(layers) == 1
    assert max(simulate_plan(best).peak_memory) <= get_hardware("H100").usable_memory


def test_rate_compares_one_knob_at_a_time_with_the_best_and_sorts_by_saving():
    import pipesim
    from pipesim.sim.plan_report import simulate_plan
    from pipesim.planner.rate import rate_plan

    best = pipesim.Plan.create("llama3-8b", "H100", tp=2, pp=2, dp=2, global_batch_size=16,
                               schedule="interleaved", vpp=2, sequence_parallel=True, zero=1)
    mine = pipesim.Plan.create("llama3-8b", "H100", tp=1, pp=4, dp=2, global_batch_size=16,
                               recompute="full")
    r = rate_plan(mine, best, 70e9)
    assert r.step_time == simulate_plan(mine).step_time
    assert r.relative == pytest.approx(simulate_plan(best).step_time / r.step_time)
    knobs = {c.knob: c for c in r.changes}
    assert set(knobs) == {"schedule", "tp", "pp", "recompute", "zero", "sequence_parallel"}
    # tp 1 -> 2 keeps the 8 GPUs: dp moves, 2 -> 1
    tp = simulate_plan(mine.with_(tp=2, dp=1)).step_time
    assert knobs["tp"].step_time == pytest.approx(tp)
    steps = [c.step_time for c in r.changes if c.step_time is not None]
    assert steps == sorted(steps)
    assert "0.60x" in r.text() or f"{r.relative:.2f}x" in r.text()
    # the two that save the most, together: the plan with both knobs set by hand
    first, second = [c for c in r.changes if c.step_time is not None][:2]
    assert first.step_time < r.step_time and second.step_time < r.step_time
    both = mine
    for c in (first, second):
        value = (best.schedule_name, best.parallelism.vpp) if c.knob == "schedule" else \
            getattr(best.parallelism, c.knob)
        if c.knob == "schedule":
            both = both.with_(schedule=value[0], vpp=value[1])
        elif c.knob in ("tp", "pp"):
            sizes = {"tp": both.parallelism.tp, "pp": both.parallelism.pp, c.knob: value}
            both = both.with_(**{c.knob: value,
                                 "dp": mine.world_size // (sizes["tp"] * sizes["pp"])})
        else:
            both = both.with_(**{c.knob: value})
    t = r.together
    assert t.knob == f"{first.knob} + {second.knob}"
    assert t.step_time == pytest.approx(simulate_plan(both).step_time, rel=1e-12)
    assert "the two largest together: " in r.text()
    assert rate_plan(best, best, 70e9).changes == []
    assert rate_plan(best, best, 70e9).together is None
    with pytest.raises(pipesim.PlanError, match="--gpus"):
        rate_plan(mine.with_(dp=1), best, 70e9)


def test_rate_moves_a_named_layer_split_and_selective_modules_with_their_knobs():
    """A layout written for 4 stages (Megatron's --pipeline-model-parallel-layout) means
    nothing for 2: pp 4 -> 2 takes the best plan's split of the layers, and recomputation
    other than selective drops selective's modules; each change equals the plan changed by
    hand (before, both were refused as not valid alone)."""
    import pipesim
    from pipesim.planner.rate import rate_plan
    from pipesim.sim.plan_report import simulate_plan

    best = pipesim.Plan.create("llama3-8b", "H100", pp=2, dp=4, global_batch_size=16)
    mine = pipesim.Plan.create("llama3-8b", "H100", pp=4, dp=2, global_batch_size=16,
                               partition_layout="Et*7|t*9|t*8|t*8L", recompute="selective",
                               recompute_modules=("mlp",))
    assert mine.stage_layers() == [7, 9, 8, 8]
    knobs = {c.knob: c for c in rate_plan(mine, best, 70e9).changes}
    by_hand = dataclasses.replace(mine, partition_layout=None).with_(pp=2, dp=4)
    assert by_hand.stage_layers() == best.stage_layers() == [16, 16]
    assert knobs["pp"].step_time == pytest.approx(simulate_plan(by_hand).step_time, rel=1e-12)
    none = mine.with_(recompute="none", recompute_modules=())
    assert knobs["recompute"].step_time == pytest.approx(simulate_plan(none).step_time,
                                                         rel=1e-12)
    # a split the plan does not name (an even one) is not the rater's to replace
    even = dataclasses.replace(mine, partition_layout=None)
    pp = {c.knob: c for c in rate_plan(even, best, 70e9).changes}["pp"]
    assert pp.step_time == pytest.approx(simulate_plan(by_hand).step_time, rel=1e-12)


def test_robustness_reranks_under_the_models_uncertainty_and_reports_a_changed_order():
    import pipesim
    from pipesim.planner.robustness import robustness_check, scaled

    # a compute-bound plan and a communication-bound one, nearly tied nominally (dp 16 with
    # one GPU an NVLink domain: each rank's gradients on its own NIC, not its node's eight)
    a = pipesim.Plan.create("llama3-8b", "H100", tp=1, pp=1, dp=16, global_batch_size=32,
                            overlap_grad_reduce=False, nvlink_domain=1)
    b = pipesim.Plan.create("llama3-8b", "H100", tp=8, pp=1, dp=2, global_batch_size=32)
    hw = scaled(a, 0.9, 1.2).cluster.hardware
    assert hw.gemm_e_max == pytest.approx(a.cluster.hardware.gemm_e_max * 0.9)
    assert hw.network_bandwidth == pytest.approx(a.cluster.hardware.network_bandwidth * 1.2)
    same = robustness_check([a, a], ["a", "a2"])
    assert not same.unstable and "holds in every one" in same.text()
    ta = pipesim.simulate(a).step_time
    tb = pipesim.simulate(b).step_time
    first, second = (a, b) if ta <= tb else (b, a)
    rep = robustness_check([first, second], ["first", "second"], efficiency=0.5, links=0.9)
    # each scenario's times are the plans simulated on the scaled hardware, and a scenario is
    # reported exactly when its order differs from the nominal one
    for (e, l), times in zip(rep.scenarios, rep.step_times):
        want = [pipesim.simulate(scaled(p, e, l)).step_time for p in (first, second)]
        assert times == pytest.approx(want, rel=1e-12)
    flipped = [sc for sc, t in zip(rep.scenarios, rep.step_times) if t[1] < t[0]]
    assert [sc for sc, _ in rep.unstable] == flipped
    assert rep.winner_stable == (not flipped)
    # at +-50% / +-90% these two plans (one tp-8, one dp-16 over the network) swap somewhere
    assert flipped
    assert "NOT stable" in rep.text()
