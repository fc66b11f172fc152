"""Overlapped communication as the frameworks overlap it: Megatron's --tp-comm-overlap
(userbuffers: each all-gather / reduce-scatter in tp chunks under its GEMM), Calculon's
processor_usage (the compute a hidden collective slows; calculon-ai/calculon caa4b11:
``calculon/llm/layers.py``, ``systems/h100_80g_nvl8.json``: 0.15 on NVLink, 0.02 on
InfiniBand), the data-parallel reduce under the backward, and all-gather CP's attention counted
once per computation pipeexec runs. Closed forms written out by hand."""
from __future__ import annotations

import argparse
import math

import pytest

import pipesim
from pipesim.hardware import get_hardware, hardware_names
from pipesim.plan import collectives as coll
from pipesim.plan.model import ModelSpec
from pipesim.plan.flags import add_plan_flags, apply_flags, given_dests
from pipesim.plan.overlap import added

GPT = ModelSpec("gpt", 16, 2048, 16, 1024, 51200)
FREE = dict(intra_bandwidth=math.inf, inter_bandwidth=math.inf, intra_latency=0.0,
            inter_latency=0.0)
RING_H100 = get_hardware("H100").with_(nccl_arch="")     # the plain ring: closed forms by hand


def test_calculons_overlap_model_closed_form():
    u = 0.15
    # communication that fits slows the compute by u of itself; beyond, the excess shows
    assert added(1.0, 10.0, u) == pytest.approx(0.15)
    assert added(10.0, 1.0, u) == pytest.approx(9.0)
    edge = 1.0 / (1 - u)                        # where the two regimes meet: continuous
    assert added(edge, 1.0, u) == pytest.approx(edge * u) == pytest.approx(edge - 1.0)
    # in T tiles the first GEMM chunk runs on local data: the window is (T - 1) / T of it
    assert added(3.0, 4.0, u, tiles=4) == pytest.approx(3.0 - 3.0 + 3.0 * u)
    assert added(5.0, 4.0, u, tiles=4) == pytest.approx(5.0 - 3.0)
    assert added(2.0, 0.0, u) == 2.0 and added(0.0, 5.0, u) == 0.0


@pytest.mark.parametrize("name", hardware_names())
def test_every_preset_names_its_processor_usage_and_its_source(name):
    hw = get_hardware(name)
    assert (hw.link_processor_usage, hw.network_processor_usage) == (0.15, 0.02)
    assert "Calculon" in hw.source("link_processor_usage")
    assert "processor_usage 0.15 on NVLink, 0.02 on InfiniBand" in hw.source("network_processor_usage")


def test_a_measured_file_has_no_processor_usage_and_bad_values_are_refused():
    cpu = get_hardware("tests/data/cpu_2core_hardware.json")
    assert cpu.link_processor_usage == cpu.network_processor_usage == 0.0
    assert "link_processor_usage" not in cpu.to_dict()
    for bad in (1.0, -0.1, "0.1", True):
        with pytest.raises(ValueError, match="link_processor_usage must be a number in"):
            cpu.with_(link_processor_usage=bad)


def test_tp_comm_overlap_hides_each_collective_under_its_gemm_as_userbuffers_does():
    kw = dict(tp=4, pp=2, global_batch_size=2, sequence_parallel=True, efficiency=0.5,
              flash_attention=False)
    ub = pipesim.Plan.create(GPT, RING_H100, overlap_tp_comm=True, **kw)
    free = ub.with_(**FREE)
    hw = ub.cluster.hardware
    link = ub.derive().links["tp"]
    act = 2 * GPT.seq_length * GPT.hidden                       # bf16, one sequence
    ag, rs = coll.all_gather(act, 4, link), coll.reduce_scatter(act, 4, link)
    assert ag == pytest.approx(3 * hw.link_latency + 3 / 4 * act / link.bandwidth)
    rate = hw.peak_flops * 0.5
    T, h, f = GPT.seq_length, GPT.hidden, 4 * GPT.hidden
    qkv, proj = 2 * T * 3 * h / 4 * h / rate, 2 * T * h * h / 4 / rate
    fc1, fc2 = 2 * T * f / 4 * h / rate, 2 * T * h * f / 4 / rate

    def hide(c, g):                  # 4 chunks: 3 transfers under 3/4 of the GEMM, u = 0.15
        w = 0.75 * g
        return c - w if c * 0.85 > w else 0.15 * c

    per_f = hide(ag, qkv) + hide(rs, proj) + hide(ag, fc1) + hide(rs, fc2)
    per_i = hide(rs, qkv) + hide(ag, proj) + hide(rs, fc1) + hide(ag, fc2)
    n = GPT.layers // 2
    got_f = ub.costs().forward[1] - free.costs().forward[1]
    got_i = ub.costs().backward_input[1] - free.costs().backward_input[1]
    # the last stage's output layer: its input gathered in F, its gradient reduce-scattered
    # in I, exposed (outside the transformer layers' userbuffers)
    assert got_f == pytest.approx(n * per_f + ag, rel=1e-9)
    assert got_i == pytest.approx(n * per_i + rs, rel=1e-9)
    # less than exposing them, more than hiding them for free
    exposed = pipesim.Plan.create(GPT, RING_H100, **kw)
    assert free.costs().forward[1] < ub.costs().forward[1] < exposed.costs().forward[1]


def test_the_data_parallel_reduce_under_the_backward_slows_it_by_the_processor_usage():
    # one node (NVLink), a backward of 8 sequences: long enough to hide the reduce
    p = pipesim.Plan.create(GPT, RING_H100, dp=8, micro_batch_size=8, global_batch_size=64)
    d = p.derive()
    assert sum(d.costs.backward[0:1]) > d.tail[0].dp_comm
    comm = d.tail[0].dp_comm
    total = sum(d.stage_params[0].values())
    # Megatron-Core DDP's buckets (bucket_size max(40M, 1M x dp) parameters on the first
    # rank's first chunk, cut evenly here): the last one's reduction is exposed
    last = comm / math.ceil(total / max(40e6, 1e6 * 8))
    assert d.tail[0].dp_exposed == pytest.approx(last + 0.15 * (comm - last), rel=1e-12)
    none = p.with_(cluster=p.cluster.with_(hardware=RING_H100.with_(link_processor_usage=0.0)))
    assert none.derive().tail[0].dp_exposed == pytest.approx(last, rel=1e-12)


def test_all_gather_cp_counts_the_attention_once_per_computation_pipeexec_runs():
    """pipeexec's all-gather CP (pipeexec/parallel/context.py): F one attention over the
    gathered sequence under an explicit mask (every block: twice the causal kernel's); I its
    forward recomputed, then its backward; selective recomputation adds nothing more (the
    attention core is what it recomputes), full recomputation the layer's forward once."""
    kw = dict(cp=2, pp=2, global_batch_size=2, efficiency=0.5, flash_attention=False, **FREE)
    ag = pipesim.Plan.create(GPT, RING_H100, cp_comm="all_gather", **kw)
    sel = ag.with_(recompute="selective")
    assert sel.costs().backward_input == ag.costs().backward_input
    full = ag.with_(recompute="full")
    assert full.costs().backward_input[0] == pytest.approx(     # stage 0: layers only
        ag.costs().backward_input[0] + ag.costs().forward[0], rel=1e-12)


def test_the_flags_set_the_plan_fields_in_every_command():
    parser = argparse.ArgumentParser()
    add_plan_flags(parser)
    base = pipesim.Plan.create(GPT, "H100", tp=2, cp=2, global_batch_size=1)
    for argv in (["--tp-comm-overlap", "--cp-comm", "all_gather"],
                 ["--tp-comm-overlap", "--cp-comm=all_gather"]):
        ns = parser.parse_args(argv)
        out = apply_flags(base, ns, given_dests(parser, argv))
        assert out.parallelism.overlap_tp_comm and out.parallelism.cp_comm == "all_gather"
    ns = parser.parse_args(["--no-tp-comm-overlap"])
    assert not apply_flags(base.with_(overlap_tp_comm=True), ns,
                           given_dests(parser, ["--no-tp-comm-overlap"])).parallelism.overlap_tp_comm
    with pytest.raises(SystemExit):
        parser.parse_args(["--cp-comm", "a2a"])
    # the planner searches with it
    from pipesim.planner.enumerate import SearchSpace, enumerate_plans
    space = SearchSpace(GPT, gpus=8, gbs=8, hardware=get_hardware("H100"), tp=(2,), pp=(1,),
                        cp=(1,), vpp=(1,), ep=(1,), mbs=(1,), recompute=("none",), zero=(0,),
                        schedules=("1f1b",), overlap_tp_comm=True)
    plans = enumerate_plans(space).plans
    assert plans and all(p.parallelism.overlap_tp_comm for p in plans)


def test_pipeexec_warns_that_it_runs_the_tensor_parallel_collectives_exposed():
    from pipeexec.run.preflight import tp_comm_overlap_warning
    par = pipesim.Plan.create(GPT, "H100", tp=2, sequence_parallel=True, overlap_tp_comm=True,
                              global_batch_size=1).parallelism
    assert "--no-tp-comm-overlap" in tp_comm_overlap_warning(par)
    assert tp_comm_overlap_warning(par.with_(overlap_tp_comm=False)) is None
    assert tp_comm_overlap_warning(par.with_(tp=1)) is None
