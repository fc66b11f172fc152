"""Measured traces: building them from records, calibrating from them, counting memory, and a
real multi-rank profiled run with deliberately skewed clocks.

Independent references: the simulator's own traces (with known costs) stand in for measured
ones in the calibration tests; the memory test compares the meter with the bytes of the
tensors a Linear-GELU-Linear stage saves, written out by hand.
"""
from __future__ import annotations

import math
import os
import socket

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

import pipesim
from pipeexec.measuring.recorder import ActionRecord
from pipeexec.analysis import MeasuredRun, build_trace
from pipeexec.measuring.profile_options import parse_step_range
from pipeexec.analysis.calibrate import Layout, calibrate, fit_run, repartition, stage_memory
from pipeexec.analysis.measured_run import COLUMNS
from pipeexec.measuring.memory import HeldTensorMeter
from pipesim.schedule.action import Action

NAN = math.nan


def rec(step, op, stage, mb, start, end, wait=(NAN, NAN), nbytes=0, mem=(NAN, NAN)):
    return ActionRecord(step, op, stage, mb, start, end, wait[0], wait[1], nbytes, mem[0], mem[1])


# -- build_trace ---------------------------------------------------------------------------------
def test_build_trace_aligns_clocks_splits_waits_and_ends_sends_at_arrival():
    s = pipesim.build_schedule("gpipe", pp=2, microbatches=1)
    # rank 1's clock runs 100 s ahead of rank 0's: offset -100 maps it back.
    r0 = [rec(0, "F", 0, 0, 1.0, 2.0), rec(0, "SEND_F", 0, 0, 2.0, 2.01, nbytes=64),
          rec(0, "RECV_B", 0, 0, 2.02, 2.03, nbytes=64),
          rec(0, "B", 0, 0, 2.03, 5.0, wait=(2.03, 4.0))]
    r1 = [rec(0, "RECV_F", 1, 0, 100.5, 100.6, nbytes=64),
          rec(0, "F", 1, 0, 100.6, 103.0, wait=(100.6, 102.2)),
          rec(0, "B", 1, 0, 103.0, 103.9), rec(0, "SEND_B", 1, 0, 103.9, 103.91, nbytes=64)]
    t = build_trace([r0, r1], [0.0, -100.0], s)
    assert list(t.columns) == list(COLUMNS)
    # On rank 0's clock the earliest row is rank 1's receive wait, from when rank 1 was free
    # (its first action, posting the receive at 100.5 - 100 = 0.5): times shift by 0.5.
    def at(x):
        return pytest.approx(x - 0.5)

    def row(rank, op):
        return t[(t["rank"] == rank) & (t["op"] == op)].iloc[0]
    assert (row(0, "F").start, row(0, "F").end) == (at(1.0), at(2.0))
    recv_f = row(1, "RECV_F")       # free at 0.5, data at 2.2; bytes of the posting
    assert (recv_f.start, recv_f.end, recv_f.bytes, recv_f.peer) == (at(0.5), at(2.2), 64, 0)
    assert row(1, "F").start == at(2.2)                     # compute starts when data is there
    assert row(1, "F").compute_start == at(2.2)
    send_f = row(0, "SEND_F")       # ends at the observed arrival
    assert send_f.start == at(2.0) and send_f.end == at(2.2) and bool(send_f.arrival_observed)
    assert send_f.link_start == at(2.0)                     # later posting: the send's
    recv_b = row(0, "RECV_B")       # free since B's predecessor ended (2.0)
    assert (recv_b.start, recv_b.end) == (at(2.0), at(4.0))
    assert row(0, "B").start == at(4.0)
    assert row(1, "SEND_B").end == at(4.0)
    # rank 1's B did not wait: it starts when F ended, executor work in between included
    assert row(1, "B").start == at(3.0)
    assert len(t) == 8 and set(t["kind"]) == {"compute", "comm"}


def test_build_trace_send_to_a_receiver_that_did_not_wait_ends_at_its_look():
    s = pipesim.build_schedule("gpipe", pp=2, microbatches=1, forward_only=True)
    r0 = [rec(0, "F", 0, 0, 0.0, 1.0), rec(0, "SEND_F", 0, 0, 1.0, 1.001, nbytes=8)]
    r1 = [rec(0, "RECV_F", 1, 0, 2.0, 2.001, nbytes=8),
          rec(0, "F", 1, 0, 2.001, 3.0, wait=(2.001, 2.00101))]
    t = build_trace([r0, r1], [0.0, 0.0], s)
    send = t[t["op"] == "SEND_F"].iloc[0]
    assert send.end == pytest.approx(2.00101) and not send.arrival_observed
    f1 = t[(t["op"] == "F") & (t["stage"] == 1)].iloc[0]
    # no real wait: the computation spans from when the rank was free (its first action)
    assert (f1.start, f1.compute_start) == (pytest.approx(2.0), pytest.approx(2.00101))


def test_build_trace_rejects_a_stage_on_the_wrong_rank():
    s = pipesim.build_schedule("gpipe", pp=2, microbatches=1)
    with pytest.raises(ValueError, match="rank 0 recorded 1F0"):
        build_trace([[rec(0, "F", 1, 0, 0.0, 1.0)], []], [0.0, 0.0], s)


def test_parse_step_range():
    assert parse_step_range("2:5") == (2, 5)
    assert parse_step_range("3") == (3, 4)
    for bad in ("5:2", "x", "-1:2"):
        with pytest.raises(ValueError, match="--profile"):
            parse_step_range(bad)


# -- calibration from synthetic traces ------------------------------------------------------------
def as_measured(result: "pipesim.SimResult", schedule: "pipesim.Schedule", *, steps: int = 1,
                act=None, bounds=None, kinds=None) -> MeasuredRun:
    """A simulated trace dressed as a measured run (every arrival observed)."""
    frames = []
    for k in range(steps):
        t = result.trace.copy()
        t["op"] = t["op"].astype(str)
        t["kind"] = t["kind"].astype(str)
        t["step"] = k
        t["mem_start"] = 0.0
        t["mem_end"] = 0.0
        if act is not None:       # F leaves act[stage] held, B releases it
            t.loc[t["op"] == "F", "mem_end"] = [act[s] for s in t.loc[t["op"] == "F", "stage"]]
            t.loc[t["op"] == "B", "mem_start"] = [act[s] for s in t.loc[t["op"] == "B", "stage"]]
        t["arrival_observed"] = True
        t["link_start"] = t["start"]
        frames.append(t)
    n = schedule.num_stages
    meta = {"schedule": schedule.name, "pp": schedule.pp, "vpp": schedule.vpp,
            "microbatches": schedule.num_microbatches,
            "bounds": bounds or list(range(n + 1)), "layer_kinds": kinds or ["block"] * n}
    return MeasuredRun(pd.concat(frames, ignore_index=True), meta)


def test_calibration_recovers_known_costs_from_a_synthetic_trace():
    s = pipesim.build_schedule("zb-h1", pp=4, microbatches=8)
    truth = pipesim.CostModel(forward=[1.0, 1.2, 0.9, 1.5], backward_input=[1.1, 1.0, 1.3, 0.8],
                              backward_weight=[0.7, 0.9, 0.6, 1.0], p2p_latency=0.05,
                              p2p_bandwidth=1e3, p2p_bytes=[40.0, 100.0, 160.0, 0.0])
    run = as_measured(pipesim.simulate(s, truth, jitter=0.05, seed=3), s, act=[10, 20, 30, 40])
    fitted = fit_run(run)
    np.testing.assert_allclose(fitted.stage_values("forward", 4), truth.forward, rtol=0.03)
    np.testing.assert_allclose(fitted.stage_values("backward_input", 4), truth.backward_input, rtol=0.03)
    np.testing.assert_allclose(fitted.stage_values("backward_weight", 4), truth.backward_weight, rtol=0.03)
    # three message sizes on the links: latency and bandwidth are separable
    assert fitted.p2p_latency == pytest.approx(0.05, rel=1e-6)
    assert fitted.p2p_bandwidth == pytest.approx(1e3, rel=1e-6)
    mem = stage_memory(run)
    assert mem["activation_bytes"] == [10, 20, 30, 40]
    # predicted with the fitted costs, the trace comes back within the jitter
    again = pipesim.simulate(s, fitted)
    assert again.makespan == pytest.approx(pipesim.simulate(s, truth).makespan, rel=0.03)


# The built-in GPT's 8 layers, cut into 4 stages (E+B, B+B, B+B, B+H) and into 8 of one layer.
KINDS = ("embedding",) + ("block",) * 6 + ("head",)
SRC = Layout((0, 2, 4, 6, 8), KINDS)
DST = Layout(tuple(range(9)), KINDS)


def stage_sums(per_kind: dict[str, float], layout: Layout) -> list[float]:
    """Each stage's value: the sum of its layers' per-kind values."""
    return [sum(per_kind[layout.layer_kinds[k]] for k in range(a, b))
            for a, b in zip(layout.bounds, layout.bounds[1:])]


def test_repartition_sums_per_kind_costs_over_the_new_stages():
    kinds, src, dst = KINDS, SRC, DST
    per_kind = {"embedding": 0.2, "block": 1.0, "head": 0.6}
    stage_f = stage_sums(per_kind, src)
    cal = repartition(pipesim.CostModel(forward=stage_f, backward=[2 * x for x in stage_f]), src, dst)
    expect = [per_kind[k] for k in kinds]
    np.testing.assert_allclose(cal.costs.stage_values("forward", 8), expect, atol=1e-12)
    np.testing.assert_allclose(cal.costs.stage_values("backward", 8), [2 * x for x in expect], atol=1e-12)
    assert cal.underdetermined == [] and cal.repartitioned
    # two stages cannot separate three kinds: flagged
    two = Layout((0, 4, 8), kinds)
    f2 = stage_sums(per_kind, two)
    assert repartition(pipesim.CostModel(forward=f2), two, dst).underdetermined
    with pytest.raises(ValueError, match="same model"):
        repartition(pipesim.CostModel(forward=f2), two, Layout((0, 1, 2), ("block",) * 2))


def test_repartition_keeps_the_first_stage_without_an_input_gradient():
    # The first stage's I does nothing and its W is its whole backward, whatever layers it
    # holds: fitted per kind, the block's I would be pulled towards zero by the first stage's.
    kinds, src, dst = KINDS, SRC, DST
    i_kind = {"embedding": 0.0, "block": 1.0, "head": 0.4}
    w_kind = {"embedding": 0.1, "block": 0.8, "head": 0.3}
    stage_i, stage_w = stage_sums(i_kind, src), stage_sums(w_kind, src)
    stage_w[0] += stage_i[0]                       # the first stage: all of it in W
    stage_i[0] = 0.01                              # a no-op I still costs the executor a little
    f = [1.0] * 4
    cal = repartition(pipesim.CostModel(forward=f, backward_input=stage_i,
                                        backward_weight=stage_w), src, dst)
    i = cal.costs.stage_values("backward_input", 8)
    w = cal.costs.stage_values("backward_weight", 8)
    np.testing.assert_allclose(i[1:], [i_kind[k] for k in kinds[1:]], atol=1e-9)
    np.testing.assert_allclose(w[1:], [w_kind[k] for k in kinds[1:]], atol=1e-9)
    assert i[0] == pytest.approx(0.01)             # the first stage's measured no-op I
    # W of the new first stage (the embedding alone): its whole backward, never negative
    assert 0.0 <= w[0] <= w_kind["embedding"] + 1e-9


def test_repartition_fits_what_i_frees_per_layer_kind():
    # I frees the loss computation's saved tensors on the head and nothing on a block: a mean
    # fraction over the source stages would spread the head's release over every block.
    act = stage_sums({"embedding": 10.0, "block": 100.0, "head": 60.0}, SRC)
    freed = stage_sums({"embedding": 0.0, "block": 0.0, "head": 20.0}, SRC)
    costs = pipesim.CostModel(forward=1.0, activation_bytes=act,
                              weight_grad_fraction=[1 - f / a for f, a in zip(freed, act)])
    got = repartition(costs, SRC, DST).costs.stage_values("weight_grad_fraction", 8)
    assert got == pytest.approx([1.0] * 7 + [1 - 20.0 / 60.0])


def test_repartition_takes_the_embedding_and_head_pinned_not_solved_from_the_sums():
    # Blocks of the middle stages measured 15% slow (noise, contention): solved from the sums
    # alone, the first and last stages' excess of a block lands on the embedding (clipped to
    # nothing) and the head (half its cost). Pinned at what they were timed alone, the solve
    # fits only the blocks, and each one-layer target stage gets its own layer's cost.
    per_kind = {"embedding": 0.05, "block": 1.0, "head": 0.3}
    stage_f = stage_sums(per_kind, SRC)
    stage_f[1] *= 1.15
    stage_f[2] *= 1.15
    costs = pipesim.CostModel(forward=stage_f)
    solved = repartition(costs, SRC, DST).costs.stage_values("forward", 8)
    assert solved[0] < 0.01 and solved[-1] < 0.2          # what pinning is for
    pinned = repartition(costs, SRC, DST, pinned={"forward": {"embedding": 0.05, "head": 0.3}})
    got = pinned.costs.stage_values("forward", 8)
    assert got[0] == pytest.approx(0.05) and got[-1] == pytest.approx(0.3)
    # the blocks: least squares over the four stages less the pinned layers
    block = float(np.linalg.lstsq(np.array([[1.0], [2], [2], [1]]),
                                  np.array(stage_f) - [0.05, 0, 0, 0.3], rcond=None)[0][0])
    np.testing.assert_allclose(got[1:-1], [block] * 6)
    assert pinned.pinned == {"forward": {"embedding": 0.05, "head": 0.3}}


def test_calibrate_pins_the_layers_a_run_timed_alone():
    # A run's layer probe (pipeexec.measuring.probe.probe_layers): the embedding took 4% of
    # stage 0's F, the head 20% of stage 1's; calibrate pins them at those shares.
    s = pipesim.build_schedule("1f1b", pp=2, microbatches=4)
    kinds = ["embedding", "block", "block", "head"]
    stage_f = [1.25, 1.5]
    run = as_measured(pipesim.simulate(s, pipesim.CostModel(forward=stage_f)), s,
                      bounds=[0, 2, 4], kinds=kinds)
    run.meta["layer_probe"] = {"0": {"embedding": {"share_wall": {"F": 0.04}}},
                               "1": {"head": {"share_wall": {"F": 0.2}}}}
    assert run.layer_shares() == {0: {"embedding": {"F": 0.04}}, 1: {"head": {"F": 0.2}}}
    four = calibrate(run, Layout((0, 1, 2, 3, 4), tuple(kinds)))
    f = four.costs.stage_values("forward", 4)
    assert f[0] == pytest.approx(0.04 * 1.25) and f[3] == pytest.approx(0.2 * 1.5)
    assert sum(f) == pytest.approx(sum(stage_f), rel=0.05)


def test_repartition_fits_a_per_action_cost_when_stage_sizes_identify_it():
    # Stages of 2, 3, 2, 2 layers: [1 | layer counts] has full rank, so a fixed cost per
    # action is told apart from the layers' costs and charged once per target stage.
    kinds = ("embedding",) + ("block",) * 7 + ("head",)
    per_kind = {"embedding": 0.2, "block": 1.0, "head": 0.6}
    over = {"F": 0.3, "B": 0.5}
    src_bounds = [0, 2, 5, 7, 9]
    s = pipesim.build_schedule("1f1b", pp=4, microbatches=4)
    stage = [sum(per_kind[kinds[i]] for i in range(a, b))
             for a, b in zip(src_bounds, src_bounds[1:])]
    truth = pipesim.CostModel(forward=[over["F"] + x for x in stage],
                              backward=[over["B"] + 2 * x for x in stage])
    run = as_measured(pipesim.simulate(s, truth), s, bounds=src_bounds, kinds=list(kinds))
    cal = calibrate(run, Layout(tuple(range(10)), kinds))
    assert cal.per_action == "fitted"
    for field, op, scale in (("forward", "F", 1.0), ("backward", "B", 2.0)):
        assert cal.per_kind[field]["per action"] == pytest.approx(over[op], abs=1e-9)
        for k, v in per_kind.items():
            assert cal.per_kind[field][k] == pytest.approx(scale * v, abs=1e-9)
        expect = [over[op] + scale * per_kind[k] for k in kinds]
        np.testing.assert_allclose(cal.costs.stage_values(field, 9), expect, atol=1e-9)


def test_repartition_keeps_the_measured_executor_overhead_per_action():
    # Equal stages (3 blocks each) cannot separate a constant from the layers: the executor's
    # own work before each computation (compute_start - start) is the per-action term.
    s = pipesim.build_schedule("1f1b", pp=2, microbatches=4)
    post, block = [0.1, 0.3], 1.0
    truth = pipesim.CostModel(forward=[p + 3 * block for p in post],
                              backward=[p + 6 * block for p in post])
    run = as_measured(pipesim.simulate(s, truth), s, bounds=[0, 3, 6], kinds=["block"] * 6)
    t = run.trace
    t["compute_start"] = t["start"]
    compute = t["kind"] == "compute"
    t.loc[compute, "compute_start"] = t.loc[compute, "start"] + [post[k] for k in t.loc[compute, "stage"]]
    cal = calibrate(run, Layout(tuple(range(7)), ("block",) * 6))
    assert cal.per_action == "executor"
    mean_post = sum(post) / 2
    np.testing.assert_allclose(cal.costs.stage_values("forward", 6), [mean_post + block] * 6)
    np.testing.assert_allclose(cal.costs.stage_values("backward", 6), [mean_post + 2 * block] * 6)
    # six actions per microbatch now pay the overhead six times, not a sixth of it twice
    assert sum(cal.costs.stage_values("forward", 6)) == pytest.approx(6 * mean_post + 6 * block)


# The main job's 1F1B cut (E+B+B, B+B, B, B+H): stage sizes 3, 2, 1, 2 identify a per-action term.
MAIN_SRC = Layout((0, 3, 5, 6, 8), KINDS)


def per_action_truth(pre: float, own: float, layer: dict[str, float], layout: Layout) -> list[float]:
    """Each stage's cost in the per-action model: the executor's work before the computation
    (``pre``), the computation's own fixed cost (``own``) and its layers' costs."""
    return [pre + own + x for x in stage_sums(layer, layout)]


def test_repartition_recovers_the_per_action_cost_beside_pinned_edge_layers():
    # A layer timed alone (the probe) is an action of its own: its time holds the computation's
    # fixed cost ``own`` once, but not the executor's work before it (``pre``, compute_start -
    # start). The repartition recovers ``own`` and the block from the stage sums, and every
    # target stage costs what the truth says: the embedding alone pre + own + its layer.
    pre, own = 0.1, 0.3
    layer = {"embedding": 0.05, "block": 1.0, "head": 0.2}
    costs = pipesim.CostModel(forward=per_action_truth(pre, own, layer, MAIN_SRC))
    timed_alone = {"embedding": own + layer["embedding"], "head": own + layer["head"]}
    for dst in (DST, Layout((0, 2, 3, 4, 5, 6, 8), KINDS)):     # one layer a stage; E+B, B+H
        cal = repartition(costs, MAIN_SRC, dst, overhead={"forward": [pre] * 4},
                          pinned={"forward": timed_alone})
        assert cal.per_action == "fitted"
        assert cal.per_kind["forward"]["per action"] == pytest.approx(pre + own)
        assert cal.per_kind["forward"]["executor per action"] == pytest.approx(pre)
        assert cal.per_kind["forward"]["block"] == pytest.approx(layer["block"])
        np.testing.assert_allclose(cal.costs.stage_values("forward", dst.num_stages),
                                   per_action_truth(pre, own, layer, dst), atol=1e-9)


def test_repartition_puts_no_fitted_intercept_on_an_embedding_or_head_only_stage():
    # No fixed cost beyond the executor's, but the one-block stages of the source ran 60% slow
    # (a loaded machine): fitted as ``intercept + blocks x block``, the sums say a block costs
    # 0.28 and every action 1.54 more, and the embedding-only stage would cost ten times its
    # truth. Pinned edge layers timed alone cost what they took plus the executor's work; the
    # computation's own term cannot exceed what the costliest layer timed alone took in all.
    pre = 0.1
    layer = {"embedding": 0.05, "block": 1.0, "head": 0.2}
    stage_f = per_action_truth(pre, 0.0, layer, MAIN_SRC)
    stage_f[2] *= 1.6
    stage_f[3] *= 1.6
    pinned = {"embedding": layer["embedding"], "head": layer["head"]}
    values = np.array(stage_f) - [pinned["embedding"], 0, 0, pinned["head"]]
    naive = np.linalg.lstsq(np.array([[1.0, 2], [1, 2], [1, 1], [1, 1]]), values, rcond=None)[0]
    assert naive[0] > 1.0                                 # the ill-conditioned intercept
    cal = repartition(pipesim.CostModel(forward=stage_f), MAIN_SRC, DST,
                      overhead={"forward": [pre] * 4}, pinned={"forward": pinned})
    f = cal.costs.stage_values("forward", 8)
    assert f[0] == pytest.approx(pre + layer["embedding"])
    assert f[-1] == pytest.approx(pre + layer["head"])
    assert 0.0 <= cal.per_kind["forward"]["per action"] <= pre + layer["head"] + 1e-12


def test_repartition_keeps_the_embedding_only_first_stage_as_timed_alone():
    # A first stage of the embedding alone, pinned in I and W: the probe timed it as a first
    # stage (I a no-op, W its whole backward), so the target's first stage keeps those, not
    # the source first stage's I (a no-op on two blocks' worth of stage) and the rest in W.
    pre = 0.0
    f = per_action_truth(pre, 0.0, {"embedding": 0.05, "block": 1.0, "head": 0.2}, MAIN_SRC)
    i = stage_sums({"embedding": 0.0, "block": 1.0, "head": 0.4}, MAIN_SRC)
    w = stage_sums({"embedding": 0.1, "block": 0.8, "head": 0.3}, MAIN_SRC)
    w[0] += i[0]
    i[0] = 0.5                                     # the source's no-op I, slow that step
    pinned = {"backward_input": {"embedding": 0.001, "head": 0.4},
              "backward_weight": {"embedding": 0.1, "head": 0.3}}
    cal = repartition(pipesim.CostModel(forward=f, backward_input=i, backward_weight=w),
                      MAIN_SRC, DST, pinned=pinned)
    assert cal.costs.stage_values("backward_input", 8)[0] == pytest.approx(0.001)
    assert cal.costs.stage_values("backward_weight", 8)[0] == pytest.approx(0.1)
    assert cal.costs.stage_values("backward_input", 8)[-1] == pytest.approx(0.4)


def test_calibrate_uses_the_target_layout():
    s = pipesim.build_schedule("1f1b", pp=2, microbatches=4)
    kinds = ["embedding", "block", "block", "head"]
    stage_f = [0.1 + 1.0, 1.0 + 0.5]      # E+B, B+H with E=0.1, B=1.0, H=0.5
    run = as_measured(pipesim.simulate(s, pipesim.CostModel(forward=stage_f)), s,
                      bounds=[0, 2, 4], kinds=kinds)
    same = calibrate(run)
    assert not same.repartitioned
    np.testing.assert_allclose(same.costs.stage_values("forward", 2), stage_f)
    four = calibrate(run, Layout((0, 1, 2, 3, 4), tuple(kinds)))
    assert four.repartitioned and four.underdetermined     # 2 stages, 3 kinds
    assert sum(four.costs.stage_values("forward", 4)) == pytest.approx(sum(stage_f))


# -- the memory meter ------------------------------------------------------------------------------
class _Runtime:
    """What HeldTensorMeter reads from a PipelineRuntime (its public held state), all empty."""

    def held_state(self):
        return ({},) * 8


def test_held_tensor_meter_counts_exactly_what_autograd_saves():
    torch.manual_seed(0)
    b, h = 8, 16
    stage = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))
    meter = HeldTensorMeter(_Runtime(), exclude=list(stage.parameters()))
    x = torch.randn(b, h, requires_grad=True)
    assert meter.begin(Action("F", 0, 0)) == 0
    y = stage(x)
    held = meter.finish(Action("F", 0, 0))
    # Linear 1 saves its input x; GELU saves its input (Linear 1's output, b x 4h); Linear 2
    # saves its input (GELU's output, b x 4h). Weights are parameters: excluded.
    assert held == 4 * (b * h + 2 * b * 4 * h)
    y.sum().backward()
    meter.begin(Action("B", 0, 0))
    assert meter.finish(Action("B", 0, 0)) == 0
    # autograd got correct gradients through the meter's hooks
    x2 = x.detach().clone().requires_grad_(True)
    stage(x2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)


def test_held_tensor_meter_drops_a_pairs_saved_tensors_when_a_late_holder_lets_go():
    """A backward may hand a collective an unpacked input, which carries its grad_fn: until
    the collective's worker lets go (gloo's thread, about a millisecond past ``wait()``) the
    stage's retained graph, and every tensor it saved, stays alive. They are counted while
    alive and dropped at the next reading after they die, not kept to the end of the step."""
    torch.manual_seed(0)
    b, h = 8, 16
    stage = nn.Linear(h, h)
    meter = HeldTensorMeter(_Runtime(), exclude=list(stage.parameters()))
    x = torch.randn(b, h, requires_grad=True)
    late: list[torch.Tensor] = []

    class _HandsOnItsInput(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            ctx.save_for_backward(t)
            return t * 2

        @staticmethod
        def backward(ctx, g):
            (t,) = ctx.saved_tensors     # carries the Linear's grad_fn
            late.append(t)               # as a collective's worker holds its input
            return g * 2

    meter.begin(Action("F", 0, 0))
    y = _HandsOnItsInput.apply(stage(x))
    assert meter.finish(Action("F", 0, 0)) == 2 * 4 * b * h      # x and the Linear's output
    y.sum().backward(retain_graph=True)                          # as I and W keep the graph
    del y
    meter.begin(Action("B", 0, 0))
    assert meter.finish(Action("B", 0, 0)) == 4 * b * h          # x, saved by the held graph
    meter.begin(Action("F", 0, 1))
    assert meter.finish(Action("F", 0, 1)) == 4 * b * h
    late.clear()                                                 # the worker lets go
    assert meter.begin(Action("F", 0, 2)) == 0


# -- a real multi-rank run -------------------------------------------------------------------------
SKEWS = (0.0, 3.5, -2.25)      # seconds added to each rank's clock (one host shares one clock)


def profiled_worker(board, cases):
    """Train each (schedule, vpp) with a profile of steps 1..2 on deliberately skewed clocks."""
    import time

    from pipeexec.config import TrainConfig
    from pipeexec.measuring.profile_options import ProfileOptions
    from pipeexec.measuring.session import ProfileSession
    from pipeexec.topology import destroy_topology, init_topology
    from pipeexec.training.train import train
    from pipeexec.run.assemble import assemble

    topo = init_topology(len(SKEWS), 1, timeout=120)
    skew = SKEWS[topo.rank]
    out = {}
    try:
        for name, vpp in cases:
            cfg = TrainConfig.from_flat(schedule=name, pp=len(SKEWS), vpp=vpp, microbatches=4,
                                        micro_batch_size=2, layers=4, hidden=16, heads=2,
                                        seq_len=8, vocab=32, steps=3, p2p_timeout=60.0,
                                        collective_timeout=120.0)
            session = ProfileSession(ProfileOptions(1, 3, align_rounds=8), topo,
                                     clock=lambda: time.perf_counter() + skew)
            trainer = assemble(cfg, topo, board=board, recorder=session.profiler)
            session.attach(trainer)
            train(trainer)
            run = session.finish(trainer)
            out[name] = {"offset": session.offset, "run": run,
                         "records": session.profiler.records()}
    finally:
        destroy_topology(topo)
    return out


@pytest.fixture(scope="module")
def real_runs():
    from pipeexec import launch

    return launch(profiled_worker, len(SKEWS), ([("1f1b", 1), ("zbv", 2)],), timeout=240)


def causality_violations(trace: pd.DataFrame, schedule, tol: float) -> list[str]:
    """Messages that arrive before they were sent, and computations that start before the
    computation they depend on (on another rank) ended."""
    bad = []
    idx = {(r.step, r.op, r.stage, r.microbatch): r for r in trace.itertuples()}
    for r in trace.itertuples():
        if r.op in ("SEND_F", "SEND_B"):
            peer_key = (r.step, "RECV_F", r.stage + 1, r.microbatch) if r.op == "SEND_F" else \
                (r.step, "RECV_B", r.stage - 1, r.microbatch)
            recv = idx[peer_key]
            if recv.end < r.start - tol:
                bad.append(f"{r.stage}{r.op}{r.microbatch} step {r.step}: received at {recv.end} "
                           f"before sent at {r.start}")
        if r.op == "F" and r.stage > 0 and schedule.stage_rank(r.stage - 1) != r.rank:
            prev = idx[(r.step, "F", r.stage - 1, r.microbatch)]
            if r.start < prev.end - tol:
                bad.append(f"{r.stage}F{r.microbatch} step {r.step} starts {prev.end - r.start:.6f} s "
                           "before its input was computed")
    return bad


@pytest.mark.slow
@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_measured_trace_of_a_real_run_is_well_formed(real_runs, name):
    run: MeasuredRun = real_runs[0][name]["run"]
    assert all(r[name]["run"] is None for r in real_runs[1:])     # gathered on rank 0 only
    schedule = run.schedule
    offsets = [r[name]["offset"] for r in real_runs]
    # the estimated offsets undo the skews (one host: the clocks differ by the skew only)
    for o, skew in zip(offsets, SKEWS):
        assert o.offset == pytest.approx(-skew, abs=max(o.rtt, 1e-3))
    assert run.steps == [1, 2]
    # where the ranks ran: all on this host, each able to use at most its threads
    cpus = run.meta["rank_cpus"]
    assert len(cpus) == len(SKEWS) and all(0 < c <= torch.get_num_threads() for c in cpus)
    assert run.meta["hosts"] == {socket.gethostname(): {
        "cpus": os.cpu_count(), "ranks": len(SKEWS), "rank_cpus": pytest.approx(sum(cpus)),
        "max_rank_cpus": max(cpus)}}
    trace = run.trace
    for step in (1, 2):
        for rank in range(schedule.pp):
            rows = trace[(trace["step"] == step) & (trace["rank"] == rank)]
            got = sorted(f"{st}{op}{mb}" for op, st, mb in zip(rows["op"], rows["stage"], rows["microbatch"]))
            assert got == sorted(str(a) for a in schedule.actions(rank)), (step, rank)
            compute = rows[rows["kind"] == "compute"].sort_values("start")
            # compute spans of one rank never overlap and follow the schedule's order
            assert (compute["start"].to_numpy()[1:] >= compute["end"].to_numpy()[:-1] - 1e-9).all()
            order = [f"{st}{op}{mb}" for op, st, mb in zip(compute["op"], compute["stage"], compute["microbatch"])]
            assert order == [str(a) for a in schedule.compute_order(rank)]
            # everything the runtime held for the step is released by its last action
            # CPU work: positive, and no more than the wall time since the previous computation
            # (one thread cannot use more than one core; waits use none)
            prev_end = np.concatenate(([compute["start"].iloc[0]], compute["end"].to_numpy()[:-1]))
            assert (compute["cpu"] > 0).all()
            assert (compute["cpu"].to_numpy() <= compute["end"].to_numpy() - prev_end + 2e-3).all()
            last = schedule.actions(rank)[-1]
            final = rows[(rows["op"] == last.op) & (rows["stage"] == last.stage)
                         & (rows["microbatch"] == last.microbatch)]
            assert final["mem_end"].item() == 0
            assert compute["mem_end"].max() > 0
    # receive waits were recorded: each RECV row ends where its computation proper begins
    recvs = trace[trace["op"].isin(["RECV_F", "RECV_B"])]
    comp = trace[trace["kind"] == "compute"].set_index(["step", "stage", "microbatch", "op"])
    for r in recvs.itertuples():
        consumer = comp.loc[(r.step, r.stage, r.microbatch, "F" if r.op == "RECV_F" else
                             ("B" if (r.step, r.stage, r.microbatch, "B") in comp.index else "I"))]
        assert consumer["compute_start"] == r.end
    assert trace["arrival_observed"].any()
    tol = max(o.rtt for o in offsets) + 1e-4
    assert causality_violations(trace, schedule, tol) == []
    # without the alignment the skewed clocks break causality: the check can fail
    raw = [r[name]["records"] for r in real_runs]
    unaligned = build_trace(raw, [0.0] * len(raw), schedule)
    assert causality_violations(unaligned, schedule, tol)
    # the split probe timed every stage; the first stage has no input gradient to compute
    probe = run.meta["split_probe"]
    assert sorted(probe, key=int) == [str(s) for s in range(schedule.num_stages)]
    for p in probe.values():
        assert all(p["wall"][op] > 0 for op in ("F", "B", "I", "W"))
        assert all(p["ratio_wall"][op] > 0 for op in ("I", "W"))
        # ratios of thread CPU time: a wall-time ratio moves with preemption (3 ranks share
        # 2 cores here; one CI run saw a W/B of 0.3 in wall time, about 1 in CPU time)
        assert 0.3 < p["ratio_cpu"]["W"] < 3 and p["ratio_cpu"]["I"] >= 0
    assert probe["0"]["ratio_cpu"]["I"] < 0.5 < probe["0"]["ratio_cpu"]["W"]
    # I releases the loss computation's saved tensors on the last stage (its log-softmax of
    # 2 x 8 x 32 fp32 values at least), which W does not need
    last = probe[str(schedule.num_stages - 1)]["freed_at_I"]
    assert last >= 2 * 8 * 32 * 4
    assert all(p["freed_at_I"] >= 0 for p in probe.values())
    # the embedding and the head timed alone, each a share of its own stage's time (the stage
    # holds blocks too, so less than all of it), read back as the run's layer shares
    last_stage = str(schedule.num_stages - 1)
    layers = run.meta["layer_probe"]
    assert sorted(layers) == ["0", last_stage]
    assert list(layers["0"]) == ["embedding"] and list(layers[last_stage]) == ["head"]
    bounds = run.meta["bounds"]
    for stage, kinds in layers.items():
        alone = bounds[int(stage) + 1] - bounds[int(stage)] == 1
        for p in kinds.values():
            # a stage of that layer alone (zbv here: 6 layers, 6 stages) times the same work
            # twice, a share about 1; next to blocks, a part of the stage's time
            lo, hi = (0.5, 2.0) if alone else (0.0, 1.0)
            assert all(lo < p["share_cpu"][op] < hi for op in ("F", "B", "W")), (stage, p["share_cpu"])
            assert all(p["wall"][op] > 0 for op in ("F", "B", "I", "W"))
    shares = run.layer_shares("cpu")
    assert shares[0]["embedding"]["F"] == layers["0"]["embedding"]["share_cpu"]["F"]
    # the measured run scores and draws like a simulated one
    result = run.result()
    # 0 when the busiest rank's actions tile the step (its waits measured inside them)
    assert 0 <= result.bubble_fraction < 50 and 0 <= result.bubble_rate < 1
    assert len(result.peak_memory) == schedule.pp and min(result.peak_memory) > 0
    assert result.gantt(comm=True) is not None
    events = result.to_chrome_trace()["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == len(run.step_trace(run.representative_step()))


def test_p2p_fit_uses_only_observed_arrivals_and_all_sizes():
    s = pipesim.build_schedule("1f1b", pp=4, microbatches=8)
    truth = pipesim.CostModel(forward=1.0, backward=2.0, p2p_latency=0.02, p2p_bandwidth=500.0,
                              p2p_bytes=[10.0, 20.0, 40.0, 0.0])
    run = as_measured(pipesim.simulate(s, truth), s)
    t = run.trace
    sends = t.index[t["op"].isin(["SEND_F", "SEND_B"])]
    hidden = sends[::2]                  # half the arrivals were not seen: ends are upper bounds
    t.loc[hidden, "arrival_observed"] = False
    t.loc[hidden, "end"] += 5.0
    # only the SEND_F rows of stage 2 were observed: sizes still come from every row
    fitted = pipesim.fit_costs(t, num_stages=4)
    assert fitted.p2p_latency == pytest.approx(0.02, rel=1e-6)
    assert fitted.p2p_bandwidth == pytest.approx(500.0, rel=1e-6)
    assert fitted.stage_values("p2p_bytes", 4) == [10.0, 20.0, 40.0, 0.0]
    # link_start: a transfer timed from when both sides had posted
    t["link_start"] = t["start"] - 1.0
    late = pipesim.fit_costs(t, num_stages=4)
    assert late.p2p_latency == pytest.approx(1.02, rel=1e-6)


# -- cores shared by more ranks than there are ---------------------------------------------------
def _rows(spans, cpu=None):
    rows = [{"rank": r, "op": "F", "stage": r, "chunk": 0, "microbatch": 0, "start": s, "end": e,
             "kind": "compute"} for r, (s, e) in enumerate(spans)]
    t = pd.DataFrame(rows)
    if cpu is not None:
        t["cpu"] = cpu
    return t


def test_progress_under_processor_sharing_by_hand():
    from pipeexec.analysis.contention import progress

    t = _rows([(0.0, 2.0), (1.0, 3.0)])
    # one core: alone for 1 s, shared for 1 s (half speed), alone for 1 s
    np.testing.assert_allclose(progress(t, 1.0), [1.5, 1.5])
    np.testing.assert_allclose(progress(t, 2.0), [2.0, 2.0])


def test_effective_cores_explains_the_cpu_work():
    from pipeexec.analysis.contention import effective_cores

    # two ranks computing side by side for 2 s each did 1 s of work each: one core's worth
    assert effective_cores(_rows([(0.0, 2.0), (0.0, 2.0)], cpu=[1.0, 1.0])) == pytest.approx(1.0, abs=1e-6)
    # full speed: no sign of sharing, as many cores as ranks
    assert effective_cores(_rows([(0.0, 2.0), (0.0, 2.0)], cpu=[2.0, 2.0])) == 2.0
    with pytest.raises(ValueError, match="no CPU times"):
        effective_cores(_rows([(0.0, 1.0)], cpu=[math.nan]))


@pytest.mark.parametrize("name,vpp", [("1f1b", 1), ("interleaved", 2), ("zbv", 2)])
@pytest.mark.parametrize("cores", [1.0, 1.5, 2.0, 3.0])
def test_effective_cores_recovers_the_simulated_sharing(name, vpp, cores):
    from pipeexec.analysis.contention import effective_cores, progress

    # A run simulated with 4 ranks on `cores` processors: each computation's progress over its
    # span is its work, and the fit finds the core count back from (work, spans) alone.
    s = pipesim.build_schedule(name, pp=4, microbatches=8, vpp=vpp)
    work = pipesim.CostModel(forward=[1.0, 1.3, 0.8, 1.1] * vpp, backward=2.0)
    trace = pipesim.simulate(s, work, cores=cores).trace
    rows = trace[trace["kind"] == "compute"]
    times = work.compute_times(s.num_stages)
    cpu = [times[op][st] for op, st in zip(rows["op"].astype(str), rows["stage"])]
    np.testing.assert_allclose(progress(trace, cores), cpu, rtol=1e-9)
    assert effective_cores(trace, cpu) == pytest.approx(cores, rel=1e-6)


def probe_worker(board):
    import torch

    from pipeexec.config import TrainConfig
    from pipeexec.measuring.probe import probe_split
    from pipeexec.topology import destroy_topology, init_topology
    from pipeexec.training.train import train
    from pipeexec.run.assemble import assemble

    topo = init_topology(1, 1, timeout=60)
    try:
        cfg = TrainConfig.from_flat(schedule="1f1b", pp=1, microbatches=2, micro_batch_size=2,
                                    layers=2, hidden=16, heads=2, seq_len=8, vocab=32, steps=1)
        trainer = assemble(cfg, topo, board=board)
        train(trainer)
        grads = trainer.grads.data.clone()
        params = [p.detach().clone() for p in trainer.masters.masters]
        rng = torch.get_rng_state()
        probe = probe_split(trainer)
        untouched = (torch.equal(grads, trainer.grads.data)
                     and all(torch.equal(a, b) for a, b in zip(params, trainer.masters.masters))
                     and torch.equal(rng, torch.get_rng_state()))
        return probe, untouched
    finally:
        destroy_topology(topo)


@pytest.mark.slow
def test_split_probe_leaves_training_state_alone():
    from pipeexec import launch

    probe, untouched = launch(probe_worker, 1, (), timeout=120)[0]
    assert untouched                      # no gradient, parameter or random state changed
    # one stage, first and last: its input (token ids) needs no gradient, so I does nothing
    assert list(probe) == [0] and probe[0]["ratio_cpu"]["I"] < 0.5 < probe[0]["ratio_cpu"]["W"]


def test_probed_split_gives_i_and_w_to_a_run_without_them():
    from pipeexec.analysis.calibrate import calibrate

    run = synthetic_run_without_split()
    costs = calibrate(run).costs.compute_times(2)
    assert costs["B"] == pytest.approx([2.0, 4.0])
    assert costs["I"] == pytest.approx([0.0, 4.0 * 0.6])      # B x the probed I/B of the stage
    assert costs["W"] == pytest.approx([2.0 * 1.0, 4.0 * 0.5])
    del run.meta["split_probe"]                                 # without a probe: even split
    assert calibrate(run).costs.compute_times(2)["I"] == pytest.approx([1.0, 2.0])


def test_probed_split_takes_what_i_frees_from_the_probe():

    from pipeexec.analysis.calibrate import probed_split

    run = MeasuredRun(pd.DataFrame(), {"schedule": "1f1b", "pp": 2, "vpp": 1,
                                       "microbatches": 2, "bounds": [0, 1, 2],
                                       "layer_kinds": ["block", "block"], "split_probe": {
        "0": {"ratio_wall": {"I": 0.0, "W": 1.0}, "freed_at_I": 0.0},
        "1": {"ratio_wall": {"I": 0.6, "W": 0.5}, "freed_at_I": 300.0}}})
    costs = pipesim.CostModel(forward=1.0, backward=2.0, activation_bytes=[500.0, 1000.0],
                              weight_grad_fraction=1.0)
    assert probed_split(costs, run).stage_values("weight_grad_fraction", 2) == \
        pytest.approx([1.0, 0.7])
    # a probe without the bytes (older runs): I frees nothing, as this executor's blocks show
    del run.meta["split_probe"]["1"]["freed_at_I"]
    assert probed_split(costs, run).stage_values("weight_grad_fraction", 2) == \
        pytest.approx([1.0, 1.0])
    # a run with I rows of its own keeps its measured fractions
    own = costs.with_(backward_input=1.0, backward_weight=1.0, weight_grad_fraction=0.9)
    assert probed_split(own, run) is own


def synthetic_run_without_split() -> MeasuredRun:
    s = pipesim.build_schedule("1f1b", pp=2, microbatches=4)
    t = pipesim.simulate(s, pipesim.CostModel(forward=[1.0, 2.0], backward=[2.0, 4.0])).trace.copy()
    t["op"], t["kind"] = t["op"].astype(str), t["kind"].astype(str)
    t["step"] = 0
    for c in ("mem_start", "mem_end", "link_start", "compute_start", "cpu"):
        t[c] = math.nan
    t["arrival_observed"] = False
    probe = {"0": {"ratio_wall": {"I": 0.0, "W": 1.0}}, "1": {"ratio_wall": {"I": 0.6, "W": 0.5}}}
    meta = {"schedule": "1f1b", "pp": 2, "vpp": 1, "microbatches": 4, "bounds": [0, 1, 2],
            "layer_kinds": ["block", "block"], "split_probe": probe}
    return MeasuredRun(t, meta)
