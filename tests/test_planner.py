"""The planner: enumeration, sound bounds, pruning against brute force, explain, jitter."""
from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import pipesim
from pipesim.plan.plan import Plan
from pipesim.sim.plan_report import simulate_plan
from pipesim.planner import SearchSpace, enumerate_plans, explain, jitter_check, search
from pipesim.planner.bounds import plan_bounds
from pipesim.planner.enumerate import plan_key

GiB = 2 ** 30
# SearchSpace's defaults were widened later (zero 0-3, uneven stages); these tests were written
# for, and keep, the narrower space: zero 0 and 1, Megatron's even split only
SMALL = dict(mbs=(1, 2), recompute=("none", "full"), cp=(1, 2), vpp=(2, 4), zero=(0, 1),
             uneven=False)


def small_space(**kw) -> SearchSpace:
    args = dict(model="tiny", gpus=8, gbs=16, hardware="A100", **SMALL)
    args.update(kw)
    return SearchSpace(**args)


def test_every_enumerated_plan_validates_and_knobs_multiply_to_the_world():
    space = small_space()
    enum = enumerate_plans(space)
    assert len(enum) > 100
    keys = set()
    for plan in enum.plans:
        plan.validate()
        p = plan.parallelism
        assert p.tp * p.cp * p.pp * p.dp == 8
        assert p.gbs == 16 and p.sequence_parallel == (p.tp > 1)
        keys.add(plan_key(plan))
    assert len(keys) == len(enum)            # no duplicates


def test_enumeration_against_an_independent_product_filtered_by_validate():
    """Every combination that Plan.validate accepts (and the planner's stated rules keep) is
    enumerated, and nothing else: the product is walked here with validate() as the oracle."""
    pairs = (("1f1b", 1), ("interleaved", 2), ("zbv", 2), ("dualpipev", 2), ("v-half", 2),
             ("v-min", 2), ("dualpipe", 1))      # (schedule, vpp: model parts per rank)
    space = small_space(gpus=4, gbs=8, schedules=tuple(s for s, _ in pairs), mbs=(1, 2),
                        recompute=("none",), zero=(0, 1), cp=(1, 2), vpp=(2,))
    want = set()
    for tp, cp, pp, mbs, zero, (sched, vpp) in itertools.product(
            (1, 2, 4), (1, 2), (1, 2, 4), (1, 2), (0, 1), pairs):
        if 4 % (tp * cp * pp):
            continue
        dp = 4 // (tp * cp * pp)
        if zero and dp * cp == 1:
            continue                          # the same plan as zero = 0
        if pp == 1 and sched != "1f1b":
            continue                          # no pipeline: one schedule stands for all
        if 8 % (pp * vpp):
            continue                          # tiny has 8 layers; Megatron's even split
        plan = Plan.create("tiny", "A100", schedule=sched, tp=tp, cp=cp, pp=pp, vpp=vpp, dp=dp,
                           micro_batch_size=mbs, global_batch_size=8, zero=zero,
                           sequence_parallel=tp > 1)
        try:
            plan.validate()                   # builds the schedule: its own constraints
        except ValueError:
            continue
        want.add(plan_key(plan))
    enum = enumerate_plans(space)
    got = {plan_key(p) for p in enum.plans}
    assert got == want
    assert {p.schedule for p in enum.plans} == {s for s, _ in pairs}
    # dualpipev needs m >= 2 pp: at pp 4 and 8 sequences a step there is never enough
    assert any(r.startswith("dualpipev: its constraints (vpp == 2, microbatches >= 2*pp")
               for r in enum.refused), enum.refused


def test_zb_auto_is_refused_by_the_search_space_with_the_way_to_use_it():
    with pytest.raises(ValueError, match="run zb-auto on the chosen plan"):
        small_space(schedules=("1f1b", "zb-auto"))


def test_refusals_are_counted_by_reason():
    space = dict(model="gpt3-1.3b", gpus=32, tp=(8, 16), pp=(1, 2), vpp=(2, 5), mbs=(1,),
                 recompute=("full",), zero=(1,), cp=(1, 3))
    enum = enumerate_plans(small_space(**space))
    reasons = " | ".join(enum.refused)
    assert "NVLink domain" in reasons                  # tp 16 > 8 GPUs per node
    assert "layers not divisible by pp * vpp" in reasons    # 24 layers, pp 2 x vpp 5
    assert "cp does not divide" in reasons             # cp 3
    assert all(n > 0 for n in enum.refused.values())
    across = enumerate_plans(small_space(**{**space, "tp_across_nodes": True}))
    assert "NVLink" not in " ".join(across.refused)
    assert {p.parallelism.tp for p in across.plans} == {8, 16}


def test_moe_enumerates_expert_parallelism():
    space = SearchSpace("mixtral-8x7b", gpus=16, gbs=32, mbs=(1,), recompute=("full",),
                        zero=(1,), cp=(1,), schedules=("1f1b",))
    eps = {p.parallelism.ep for p in enumerate_plans(space).plans}
    assert eps == {1, 2, 4, 8}
    for p in enumerate_plans(space).plans:
        assert (p.parallelism.dp * p.parallelism.cp) % p.parallelism.ep == 0


def test_bounds_never_exceed_the_simulation():
    for plan in enumerate_plans(small_space(gpus=8)).plans[::7]:
        b = plan_bounds(plan)
        r = simulate_plan(plan)
        assert b.step_time <= r.step_time * (1 + 1e-9), plan
        assert b.memory <= max(r.peak_memory) * (1 + 1e-9), plan
        assert plan_bounds(plan, exact_order=False).memory <= b.memory * (1 + 1e-12)


def test_step_bound_is_the_closed_form_1f1b_on_uniform_stages():
    """1F1B, uniform stages, no communication, no tail: the bound is (p-1) F + m (F + B) on the
    last rank; the simulated makespan of 1F1B is exactly (m + p - 1)(F + B) (Narayanan et al.
    2021, bubble (p-1)/m), so the bound is below by (p-1) B."""
    plan = Plan.create("tiny", "A100", schedule="1f1b", pp=4, dp=2, global_batch_size=16,
                       efficiency=0.5)
    d = plan.derive()
    f, b = d.costs.compute_times(4)["F"], d.costs.compute_times(4)["B"]
    bound = plan_bounds(plan, d)
    hop = d.costs.transfer_time(d.costs.p2p_bytes)
    tail = d.tail[3].dp_exposed + d.tail[3].optimizer
    assert bound.step_time == pytest.approx(sum(f[:3]) + 3 * hop + 8 * (f[3] + b[3]) + tail)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(gpus=st.sampled_from([2, 4, 8]), gbs=st.sampled_from([4, 8, 16]),
       limit_gib=st.sampled_from([0.35, 0.45, 0.6, 80.0]),
       schedules=st.lists(st.sampled_from(["gpipe", "1f1b", "interleaved", "zb-h1", "zbv",
                                           "dualpipev", "v-half", "v-min", "dualpipe"]),
                          min_size=1, max_size=3, unique=True),
       top=st.sampled_from([1, 3]))
# zbv and dualpipev share their parts and runs but not their ZeRO-3 gathers a microbatch: a
# bound shared between them had put dualpipev's above its simulated step
@example(gpus=8, gbs=8, limit_gib=0.35, schedules=["zbv", "dualpipev"], top=1)
def test_pruning_never_drops_the_best_plan(gpus, gbs, limit_gib, schedules, top):
    space = SearchSpace("tiny", gpus=gpus, gbs=gbs, hardware="A100", schedules=tuple(schedules),
                        mbs=(1, 2), recompute=("none", "full"), cp=(1, 2), vpp=(2,))
    enum = enumerate_plans(space)
    pruned = search(space, memory_limit=limit_gib * GiB, top=top, workers=1, enumeration=enum)
    brute = search(space, memory_limit=limit_gib * GiB, top=top, workers=1, prune=False,
                   enumeration=enum)
    assert brute.simulated == len(brute.rows[brute.rows["status"] != "invalid"])
    a, b = pruned.ranked, brute.ranked
    assert list(a["key"][:top]) == list(b["key"][:top])
    assert list(a["step_time"][:top]) == pytest.approx(list(b["step_time"][:top]))
    for s in schedules:                            # each schedule's best too (explain uses it)
        ka, kb = a[a["schedule"] == s]["key"], b[b["schedule"] == s]["key"]
        assert list(ka[:1]) == list(kb[:1])
    sim = brute.rows[brute.rows["status"] == "simulated"]
    assert (sim["step_time_bound"] <= sim["step_time"] * (1 + 1e-9)).all()
    assert (sim["memory_bound"] <= sim["peak_memory"] * (1 + 1e-9)).all()


def test_search_prunes_and_its_best_resimulates_identically(tmp_path):
    space = small_space()
    res = search(space, memory_limit=0.45 * GiB, workers=1)
    counts = res.counts()
    assert counts["pruned: memory bound"] > 0 and counts["pruned: step-time bound"] > 0
    best = res.best
    again = Plan.from_json(best.to_json(tmp_path / "p.json"))
    r = simulate_plan(again)
    row = res.ranked.iloc[0]
    assert r.step_time == row["step_time"] and max(r.peak_memory) == row["peak_memory"]
    assert r.step_time == min(res.rows["step_time"].dropna()[res.rows["fits"] == True])  # noqa: E712


def test_process_pool_gives_the_same_answer():
    space = small_space(gpus=4)
    one = search(space, workers=1)
    two = search(space, workers=2)
    assert list(one.ranked["key"][:5]) == list(two.ranked["key"][:5])
    assert list(one.ranked["step_time"][:5]) == list(two.ranked["step_time"][:5])


def test_explain_compares_other_schedules_and_one_knob_neighbours():
    res = search(small_space(), workers=1)
    table = explain(res)
    win = res.ranked.iloc[0]
    sched = table[table["kind"] == "schedule"]
    # "schedule zbv -> 1f1b[, every other knob changed]"
    assert sched["change"].str.startswith(f"schedule {win['schedule']} -> ").all()
    assert set(sched["change"].str.split(", ").str[0].str.split(" -> ").str[1]) == \
        set(res.space.schedules) - {win["schedule"]}
    assert (sched["d_step"] >= 0).all()          # the winner is the fastest that fits
    nb = table[table["kind"] == "neighbour"]
    assert len(nb) > 0
    for _, row in nb.iterrows():
        knob = row["change"].split()[0]
        other = res.rows[res.rows["key"] == row["key"]].iloc[0]
        diff = [k for k in ("tp", "cp", "pp", "vpp", "mbs", "recompute", "zero", "ep")
                if other[k] != win[k]]
        assert diff == [knob]
        assert row["step_time"] == pytest.approx(simulate_plan(res.plans[row["key"]]).step_time)
        if row["fits"]:
            assert row["d_step"] >= -1e-12


def test_jitter_check_reports_order():
    res = search(small_space(gpus=4), workers=1)
    top = res.ranked.head(4)
    plans = [res.plans[k] for k in top["key"]]
    rep = jitter_check(plans, list(top["key"]), jitter=1e-6, seeds=2)
    assert rep.order_kept == 2 and rep.winner_kept == 2   # noise far below the gaps
    rep = jitter_check(plans, list(top["key"]), jitter=0.3, seeds=3)
    assert rep.seeds == 3 and all(-1 <= t <= 1 for t in rep.kendall_tau)
    assert "seeds" in rep.text()


def test_space_refuses_bad_input():
    with pytest.raises(ValueError, match="unknown schedule"):
        small_space(schedules=("nope",))
    with pytest.raises(ValueError, match="recompute"):
        small_space(recompute=("some",))
    with pytest.raises(ValueError, match="gpus"):
        small_space(gpus=0)


def test_pruning_agrees_with_brute_force_on_a_small_moe_model():
    """Expert parallelism in the search: the pruned search and brute force pick the same top
    plans, and every bound is below its simulation."""
    from pipesim.plan.model import ModelSpec

    moe = ModelSpec("tiny-moe", layers=4, hidden=256, heads=4, seq_length=256, vocab=1000,
                    experts=4, top_k=2, moe_ffn_hidden=512, mlp="swiglu", norm="rmsnorm",
                    position="rotary", tied_embeddings=False, bias=False, dropout=False)
    space = SearchSpace(moe, gpus=4, gbs=8, hardware="A100", mbs=(1, 2),
                        recompute=("none", "full"), cp=(1,), schedules=("1f1b", "zbv"))
    enum = enumerate_plans(space)
    assert {p.parallelism.ep for p in enum.plans} == {1, 2, 4}
    brute = search(space, workers=1, prune=False, enumeration=enum)
    limit = float(brute.ranked["peak_memory"].median())       # about half the plans fit
    brute = search(space, memory_limit=limit, top=3, workers=1, prune=False, enumeration=enum)
    pruned = search(space, memory_limit=limit, top=3, workers=1, enumeration=enum)
    assert pruned.simulated < brute.simulated
    assert list(pruned.ranked["key"][:3]) == list(brute.ranked["key"][:3])
    sim = brute.rows[brute.rows["status"] == "simulated"]
    assert (sim["step_time_bound"] <= sim["step_time"] * (1 + 1e-9)).all()
    assert (sim["memory_bound"] <= sim["peak_memory"] * (1 + 1e-9)).all()


def test_zb_auto_refinement_never_loses_to_a_handcrafted_order_of_its_layout(tmp_path):
    """Each refined layout's searched plan fits the limit and is simulated no slower than
    every handcrafted schedule of its vpp (zb-auto's candidates) on the same layout that fits;
    it round-trips through JSON with its schedule as data; vpp > 2 is named, not searched."""
    from pipesim.planner.refine import refine_with_zb_auto, refinement_text
    from pipesim.zb_auto.search import HANDCRAFTED

    limit = 0.45 * GiB
    res = search(small_space(), memory_limit=limit, workers=1)
    refined = refine_with_zb_auto(res, 6)
    layouts = [tuple(r.base.parallelism.to_dict().items()) for r in refined]
    assert len(set(layouts)) == len(refined) == 6            # distinct layouts, best first
    assert [r.base_step for r in refined] == sorted(r.base_step for r in refined)
    searched = [r for r in refined if r.searched is not None]
    assert searched, refinement_text(refined)
    for r in refined:
        if r.base.parallelism.vpp > 2:
            assert r.searched is None and "vpp 1 or 2" in r.reason
    for r in searched:
        got = simulate_plan(r.searched)
        assert got.step_time == pytest.approx(r.searched_step) and got.fits
        assert max(got.peak_memory) <= limit
        for name in HANDCRAFTED[r.base.parallelism.vpp]:
            try:
                hand = simulate_plan(dataclasses.replace(r.base, schedule=name))
            except ValueError:                       # its constraints exclude this layout
                continue
            # "fits": under the search's limit, not the hardware's (the per-operator costs made a
            # faster zb-h1 at 0.46 GiB, over this 0.45 GiB limit, that zb-auto rightly skips)
            if hand.fits and max(hand.peak_memory) <= limit:
                assert r.searched_step <= hand.step_time * (1 + 1e-9), (r.base_key, name)
        again = Plan.from_json(r.searched.to_json(tmp_path / "p.json"))
        assert again.schedule == r.searched.schedule and again.schedule_name == "zb-auto"
        assert simulate_plan(again).step_time == got.step_time
    with pytest.raises(ValueError, match="top must be a positive number"):
        refine_with_zb_auto(res, 0)


@pytest.mark.parametrize("name", [n for n in pipesim.schedule_names() if n != "zb-auto"])
def test_the_registry_says_what_a_zero3_lane_bound_counts(name):
    """The lane bound counts ZeRO-3's gathers from the registry (no schedule built): one before
    each computation, so a microbatch of a part has two (F and B), three where the builder says
    every backward is split (F, I and W), at least one where it overlaps a forward with a
    backward. Checked against built schedules of a few sizes."""
    from collections import Counter

    from pipesim.schedule.registry import schedule_info

    info = schedule_info(name)
    vpp = info.searched_vpp or 2
    built = 0
    for pp, m in ((2, 4), (4, 8), (4, 12), (8, 32)):
        try:
            s = pipesim.build_schedule(name, pp=pp, microbatches=m, vpp=vpp)
        except pipesim.ScheduleError:
            continue
        built += 1
        assert s.has_overlaps == info.overlapped, (name, pp, m)
        ops = Counter(p.op for r in range(pp) for p in s.compute_parts(r))
        if info.split_backward:
            assert "B" not in ops and ops["F"] == ops["I"] == ops["W"], (name, ops)
    assert built
