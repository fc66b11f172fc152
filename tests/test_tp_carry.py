"""Carrying calibrated costs to another tp, cp or ep (`pipeexec.analysis.tensor_parallel`),
torch-free.

Closed forms: costs that are the plan's own at tp 1 carry to exactly the plan's costs at tp 2
(compute by the per-operator model, collectives from the hardware's per-collective figures);
a machine twice as slow as the plan's compute keeps that factor on compute only; the
calibration run's own collectives (tp 2 -> tp 1) are taken out.
"""
from __future__ import annotations

import pytest

from pipesim.hardware import get_hardware
from pipeexec.analysis.tensor_parallel import OPS, carry_to_layout as carry_to_tp
from pipeexec.config import TrainConfig

CFG = TrainConfig.from_flat(pp=2, microbatches=4, micro_batch_size=4, layers=6, hidden=256, heads=4,
                            seq_len=128, schedule="zbv", vpp=2)
HW = get_hardware("A100")


def plan_costs(tp: int, sp: bool = False, free: bool = False):
    plan = CFG.with_flat(tp=tp, sequence_parallel=sp).plan_as_run()
    cluster = plan.cluster.with_(hardware=HW)
    if free:
        cluster = cluster.with_(intra_bandwidth=1e30, intra_latency=0.0, inter_bandwidth=1e30,
                                inter_latency=0.0)
    return plan, plan.with_(cluster=cluster).derive().costs


@pytest.mark.parametrize("sp", [False, True])
def test_the_plans_own_costs_carry_to_the_plans_costs_at_the_other_tp(sp):
    src_plan, src = plan_costs(1)
    tgt_plan, tgt = plan_costs(2, sp)
    carried, summary = carry_to_tp(src, src_plan, tgt_plan, HW)
    n = 4
    for op in OPS + ("activation_bytes", "p2p_bytes"):
        if getattr(src, op) is None:
            continue
        assert carried.stage_values(op, n) == pytest.approx(tgt.stage_values(op, n), rel=1e-9), op
    assert all(c > 0 for c in summary["forward"]["collective_s"])
    # at these toy widths an A100's kernels are launch-bound: tp 2 saves well under half
    assert all(0.4 < r < 1.0 for r in summary["forward"]["compute_ratio"])


def test_a_slower_machine_scales_compute_not_the_collectives():
    src_plan, src = plan_costs(1)
    tgt_plan, tgt = plan_costs(2)
    _, tgt_free = plan_costs(2, free=True)
    slow = src.with_(**{op: [2 * x for x in src.stage_values(op, 4)] for op in ("forward",)})
    carried, _ = carry_to_tp(slow, src_plan, tgt_plan, HW)
    want = [2 * f + (r - f) for f, r in zip(tgt_free.stage_values("forward", 4),
                                            tgt.stage_values("forward", 4))]
    assert carried.stage_values("forward", 4) == pytest.approx(want, rel=1e-9)


def test_the_calibration_runs_own_collectives_are_taken_out():
    src_plan, src = plan_costs(2)
    tgt_plan, tgt = plan_costs(1)
    carried, summary = carry_to_tp(src, src_plan, tgt_plan, HW)
    assert carried.stage_values("forward", 4) == pytest.approx(tgt.stage_values("forward", 4),
                                                               rel=1e-9)
    assert summary["forward"]["collective_s"] == [0.0] * 4


def test_a_different_stage_count_is_refused():
    src_plan, src = plan_costs(1)
    other = CFG.with_flat(tp=2, pp=3, vpp=1, schedule="1f1b").plan_as_run()
    with pytest.raises(ValueError, match="the calibration is for 4 stages, the target has 3"):
        carry_to_tp(src, src_plan, other.with_(cluster=other.cluster.with_(hardware=HW)), HW)


def test_compare_from_a_run_at_another_tp_asks_for_the_hardware_file(capsys):
    from pathlib import Path

    from pipeexec.cli.compare import compare_main
    run = next((Path(__file__).parent / "data" / "measured_run_8ef147e").glob("*.meta.json"))
    assert compare_main(["--calibrate-from", str(run), "--tp", "2"]) == 2
    err = capsys.readouterr().err
    assert "ran at tp 1, this run at tp 2: give --hardware FILE" in err


# -- cp and ep: the same carry, both plans priced as pipeexec runs cp (all-gather) -------------
def layout_costs(free: bool = False, **sizes):
    from pipeexec.analysis.tensor_parallel import as_executed
    plan = as_executed(CFG.with_flat(**sizes).plan_as_run())
    cluster = plan.cluster.with_(hardware=HW)
    if free:
        cluster = cluster.with_(intra_bandwidth=1e30, intra_latency=0.0, inter_bandwidth=1e30,
                                inter_latency=0.0)
    return plan, plan.with_(cluster=cluster).derive()


def test_the_plans_own_costs_carry_to_cp_2_with_its_gathers_priced():
    from pipeexec.analysis.tensor_parallel import carry_to_layout
    src_plan, src = layout_costs()
    tgt_plan, tgt = layout_costs(cp=2)
    assert tgt_plan.parallelism.cp_comm == "all_gather"
    carried, summary = carry_to_layout(src.costs, src_plan, tgt_plan, HW)
    for op in OPS:
        if getattr(src.costs, op) is not None:
            assert carried.stage_values(op, 4) == pytest.approx(tgt.costs.stage_values(op, 4),
                                                                rel=1e-9), op
    cp = summary["collectives"]["cp"]
    # per stage: F the all-gather of K/V, I the gather again and the reduce-scatter
    assert cp["forward"] == [s["F"]["cp"] for s in tgt.stage_comm]
    assert all(f > 0 and i > f for f, i in zip(cp["forward"], cp["backward_input"]))
    assert summary["collectives"]["tp"]["forward"] == [0.0] * 4
    assert summary["collectives"]["ep"]["forward"] == [0.0] * 4
    # the collectives are what a free link takes away
    _, free = layout_costs(free=True, cp=2)
    assert [r - f for r, f in zip(tgt.costs.stage_values("forward", 4),
                                  free.costs.stage_values("forward", 4))] == \
        pytest.approx(cp["forward"], rel=1e-9)


def test_an_ep_carry_prices_the_all_to_alls_of_a_moe_model():
    from pipeexec.analysis.tensor_parallel import carry_to_layout, layout_note
    moe = CFG.plan.model.with_(experts=4, top_k=2, moe_ffn_hidden=256, family=None)
    cfg = CFG.replace(plan=CFG.plan.with_(model=moe)).with_flat(dp=2)
    src_plan = cfg.plan_as_run()
    tgt_plan = cfg.with_flat(ep=2).plan_as_run()
    src = src_plan.with_(cluster=src_plan.cluster.with_(hardware=HW)).derive().costs
    carried, summary = carry_to_layout(src, src_plan, tgt_plan, HW)
    ep = summary["collectives"]["ep"]
    assert all(x > 0 for x in ep["forward"] + ep["backward_input"])
    assert ep["backward_weight"] == [0.0] * 4
    note = layout_note(src_plan.parallelism, tgt_plan.parallelism, HW.name, summary)
    assert note.startswith("carried from tp 1 cp 1 ep 1 to tp 1 cp 1 ep 2") and "ep [" in note
