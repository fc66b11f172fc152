"""Per-collective link figures: the alpha-beta fit recovers the figures it was given; a hardware
file's ``collectives`` round-trip and price a plan's collectives (closed forms); files without
them load and price as before."""
from __future__ import annotations

import json
import math

import pytest

import pipesim
from pipesim.hardware import Hardware, get_hardware
from pipesim.plan import collectives as coll
from pipesim.plan.cluster import Link
from pipesim.plan.model import ModelSpec
from pipesim.planner.robustness import scaled

GPT = ModelSpec("gpt", 16, 2048, 16, 1024, 51200)
CONST = dict(efficiency=0.5)
SIZES = (4096, 16384, 65536, 262144, 1 << 20, 4 << 20, 16 << 20, 25 << 20)
# per collective, per p: (latency, bandwidth), none of them the link's pair
FIGURES = {("all_reduce", 2): (30e-6, 2.0e9), ("all_reduce", 4): (70e-6, 1.5e9),
           ("reduce_scatter", 4): (90e-6, 0.8e9), ("all_gather", 4): (50e-6, 1.2e9),
           ("all_to_all", 0): (40e-6, 0.5e9)}


def measured(base: str = "H100") -> Hardware:
    rows = tuple((kind, name, p, lat, bw) for kind in ("intra", "inter")
                 for (name, p), (lat, bw) in FIGURES.items())
    return get_hardware(base).with_(name="measured", calibration="measured", collectives=rows)


# -- the fit ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", coll.COLLECTIVES)
@pytest.mark.parametrize("p", [2, 4, 8])
def test_the_fit_recovers_latency_and_bandwidth_from_timings_drawn_from_the_model(name, p):
    a, bw = 123e-6, 1.7e9
    link = Link("intra", a, bw)
    points = [(n, coll.collective_time(name, n, p, link)) for n in SIZES]
    f = coll.fit(points, name, p)
    assert (f.name, f.p) == (name, p)
    assert f.latency == pytest.approx(a, rel=1e-9)
    assert f.bandwidth == pytest.approx(bw, rel=1e-9)
    assert all(f.time(n) == pytest.approx(t, rel=1e-9) for n, t in points)


def test_the_fit_is_in_relative_error_clamps_a_negative_latency_and_refuses_flat_times():
    steps, share = coll.factors("all_reduce", 2)
    assert (steps, share) == (2, 1.0) and coll.factors("all_gather", 4) == (3, 0.75)
    # one point 10% slow at the smallest size moves the latency, barely the bandwidth
    link = Link("intra", 50e-6, 1e9)
    points = [(n, coll.all_reduce(n, 2, link)) for n in SIZES]
    slow = [(points[0][0], points[0][1] * 1.1)] + points[1:]
    f = coll.fit(slow, "all_reduce", 2)
    assert f.bandwidth == pytest.approx(1e9, rel=0.02) and f.latency > 50e-6
    # times through the origin and below it: no negative latency
    f = coll.fit([(n, n / 1e9 - 1e-6 * (n == SIZES[0])) for n in SIZES[:3]], "all_to_all", 2)
    assert f.latency == 0.0 and f.bandwidth > 0
    with pytest.raises(ValueError, match="do not grow with the message size"):
        coll.fit([(4096, 1e-3), (1 << 20, 0.9e-3)], "all_reduce", 2)
    with pytest.raises(ValueError, match="two message sizes"):
        coll.fit([(4096, 1e-3), (4096, 2e-3)], "all_reduce", 2)
    with pytest.raises(ValueError, match="unknown collective"):
        coll.fit([(4096, 1e-3), (8192, 2e-3)], "broadcast", 2)


# -- a hardware file with per-collective figures ----------------------------------------------
def test_per_collective_figures_round_trip_through_a_hardware_file(tmp_path):
    hw = measured()
    path = tmp_path / "cpu.json"
    hw.save(path)
    data = json.loads(path.read_text())
    assert data["collectives"]["intra"]["all_reduce"]["4"] == {"latency": 70e-6,
                                                               "bandwidth": 1.5e9}
    assert data["collectives"]["inter"]["all_to_all"] == {"latency": 40e-6, "bandwidth": 0.5e9}
    back = get_hardware(str(path))
    assert back == hw and hash(back) == hash(hw)
    assert back.collective_figures("intra") == tuple(
        (n, p, lat, bw) for (n, p), (lat, bw) in sorted(FIGURES.items()))
    # a plan carries them through its own file too
    plan = pipesim.Plan.create(GPT, str(path), tp=4, global_batch_size=1)
    assert pipesim.Plan.from_dict(plan.to_dict()).cluster.hardware == hw
    for bad, match in (({"intra": {"all_reduce": {"1": {"latency": 1e-6, "bandwidth": 1e9}}}},
                        "group size must be an integer >= 2"),
                       ({"intra": {"broadcast": {"latency": 1e-6, "bandwidth": 1e9}}},
                        "'broadcast' is not one of"),
                       ({"nvlink": {"all_reduce": {"latency": 1e-6, "bandwidth": 1e9}}},
                        "link kind 'nvlink'"),
                       ({"intra": {"all_reduce": {"latency": 1e-6, "bandwidth": 0}}},
                        "bandwidth must be > 0"),
                       ({"intra": {"all_reduce": {"2": {"latency": 1e-6}}}}, "must be")):
        path.write_text(json.dumps({**hw.to_dict(), "collectives": bad}))
        with pytest.raises(ValueError, match=match):
            get_hardware(str(path))


def test_an_all_reduce_across_nodes_takes_nccls_tree_where_it_is_faster():
    """NCCL's tuner (NVIDIA/nccl src/graph/tuning.cc, Simple protocol), transcribed: the tree's
    latency 2 ((ppn - 1) + log2 nodes) steps, its bandwidth 0.92 x 0.5 of the bus bandwidth
    times treeCorrectionFactor (64 B x 2^i: 0.9 at 64 B, 0.5 at 128 KiB, 0.9 at 256 MiB)."""
    a, bw = 10e-6, 48e9
    one_each = Link("inter", a, bw, nodes=16)         # 16 ranks, one a node
    small, big = 64.0, float(256 << 20)
    tree_small = 2 * (0 + 4) * a + small / (0.46 * 0.9 * bw)
    ring_small = 2 * 15 * a + 2 * 15 / 16 * small / bw
    assert coll.all_reduce(small, 16, one_each) == pytest.approx(min(tree_small, ring_small))
    assert tree_small < ring_small                     # latency-bound: the tree
    assert coll.tree_all_reduce(128 << 10, 16, one_each) == pytest.approx(
        8 * a + (128 << 10) / (0.46 * 0.5 * bw))
    ring_big = 2 * 15 * a + 2 * 15 / 16 * big / bw
    assert coll.all_reduce(big, 16, one_each) == pytest.approx(ring_big)   # bandwidth: the ring
    # 4 ranks a node on 4 nodes: (ppn - 1) hops inside each node, log2(4) across
    four = Link("inter", a, bw, nodes=4)
    assert coll.tree_all_reduce(small, 16, four) == pytest.approx(2 * (3 + 2) * a + small / (0.46 * 0.9 * bw))
    # inside one node, or with a measured all-reduce figure: the ring only
    assert coll.all_reduce(small, 16, Link("intra", a, bw)) == pytest.approx(ring_small)
    timed = Link("inter", a, bw, (("all_reduce", 0, a, bw),), nodes=16)
    assert coll.all_reduce(small, 16, timed) == pytest.approx(ring_small)
    # the cluster says how many nodes a group spans
    cluster = pipesim.Plan.create(GPT, "H100", tp=2, dp=64, global_batch_size=64).cluster
    assert cluster.link(2, 64, 128).nodes == 16 and cluster.link(8, 16, 128).nodes == 16
    assert cluster.link(1, 8, 128).kind == "intra"


def test_a_plan_prices_each_collective_with_its_own_figure_closed_form():
    hw = measured()
    base = pipesim.Plan.create(GPT, hw, tp=4, pp=4, global_batch_size=4, flash_attention=False,
                               **CONST)
    link = base.derive().links["tp"]
    act = 2 * GPT.seq_length * GPT.hidden                  # bf16 activation of one sequence
    a4, b4 = FIGURES[("all_reduce", 4)]
    ar = 2 * 3 * a4 + 2 * 3 / 4 * act / b4                  # the ring at p = 4, its own figure
    assert coll.all_reduce(act, 4, link) == pytest.approx(ar, rel=1e-12)
    a2, b2 = FIGURES[("all_reduce", 2)]
    assert coll.all_reduce(act, 2, link) == pytest.approx(2 * a2 + act / b2, rel=1e-12)
    # p = 8 was not measured: the nearest size's (4); all-to-all: the one given for any size
    assert coll.all_reduce(act, 8, link) == pytest.approx(2 * 7 * a4 + 2 * 7 / 8 * act / b4)
    a, b = FIGURES[("all_to_all", 0)]
    assert coll.all_to_all(act, 8, link) == pytest.approx(7 * a + 7 / 8 * act / b, rel=1e-12)
    # p2p has no figure of its own: the link's pair
    assert coll.p2p(act, link) == pytest.approx(hw.link_latency + act / (hw.link_bandwidth
                                                                       * hw.link_bus_efficiency))
    # the stage costs: two all-reduces per layer forward (and the embedding's one on stage 0)
    free = base.with_(intra_bandwidth=math.inf, inter_bandwidth=math.inf, intra_latency=0.0,
                      inter_latency=0.0)               # an override is the link: no figures
    assert free.derive().links["tp"].collectives == ()
    got = [x - y for x, y in zip(base.costs().forward, free.costs().forward)]
    n = GPT.layers // 4
    assert got[1] == pytest.approx(n * 2 * ar, rel=1e-9)
    assert got[0] == pytest.approx((2 * n + 1) * ar, rel=1e-9)
    # sequence parallelism: all-gather + reduce-scatter, each its own figure now
    sp = base.with_(sequence_parallel=True)
    rs, ag = FIGURES[("reduce_scatter", 4)], FIGURES[("all_gather", 4)]
    one = sum(3 * lat + 3 / 4 * act / bw for lat, bw in (rs, ag))
    got = [x - y for x, y in zip(sp.costs().forward, sp.with_(
        intra_bandwidth=math.inf, intra_latency=0.0).costs().forward)]
    assert got[1] == pytest.approx(n * 2 * one, rel=1e-9)


def test_the_data_parallel_tail_uses_the_reduce_scatter_and_all_gather_figures():
    hw = measured()
    p = pipesim.Plan.create(GPT, hw, dp=4, zero=1, global_batch_size=16,
                            overlap_grad_reduce=False, overlap_param_gather=False, **CONST)
    d = p.derive()
    params = sum(d.stage_params[0].values())
    rs, ag = FIGURES[("reduce_scatter", 4)], FIGURES[("all_gather", 4)]
    expect = (3 * rs[0] + 3 / 4 * 4 * params / rs[1]) + (3 * ag[0] + 3 / 4 * 2 * params / ag[1])
    assert d.tail[0].dp_comm == pytest.approx(expect, rel=1e-12)
    # the engine's own (all-reduce) tail reads the all-reduce figure at dp
    assert (d.costs.dp_latency, d.costs.dp_bandwidth) == FIGURES[("all_reduce", 4)]
    # the planner's robustness scenarios scale the per-collective bandwidths as the links'
    slow = scaled(p, 1.0, 0.5).derive()
    assert slow.tail[0].dp_comm == pytest.approx(
        (3 * rs[0] + 3 / 4 * 4 * params / (rs[1] / 2)) + (3 * ag[0] + 3 / 4 * 2 * params / (ag[1] / 2)))


# -- files without them -----------------------------------------------------------------------
def test_a_hardware_file_without_collectives_loads_and_prices_as_before(tmp_path):
    """A file as calibrate-hardware wrote it before: one all-reduce fit for both links."""
    old = {"name": "cpu-2core", "peak_flops": 8e10, "memory_bytes": 2.4e10,
           "link_bandwidth": 1.1e9, "network_bandwidth": 1.1e9, "hbm_bandwidth": 7e10,
           "link_latency": 2.9e-4, "network_latency": 2.9e-4, "nvlink_domain": 1 << 20,
           "fp8_flops": 0.0, "fp32_flops": 8e10, "gemm_e_max": 0.9, "gemm_dim_half": 6.0,
           "gemm_table": [[64, 64, 64, 0.5]], "mem_efficiency": 1.0, "flash_e_max": 0.3,
           "launch_overhead": 7e-6, "memory_reserve": 0.0, "fragmentation": 1.0,
           "calibration": "measured",
           "sources": {"links": "gloo all-reduce between 2 processes, latency + bandwidth fit"}}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    hw = get_hardware(str(path))
    assert hw.collectives == () and "collectives" not in hw.to_dict()
    # its links were measured: bus bandwidths already, no efficiency on them
    # (and the low-precision and grouped-GEMM figures it did not know: none, and their defaults)
    assert hw.to_dict() == {**old, "gemm_table": [[64.0, 64.0, 64.0, 0.5]],
                            "link_bus_efficiency": 1.0, "network_bus_efficiency": 1.0,
                            "mxfp8_flops": 0.0, "nvfp4_flops": 0.0, "cast_efficiency": None,
                            "grouped_gemm_efficiency": 1.0}
    plan = pipesim.Plan.create(GPT, str(path), tp=4, dp=2, global_batch_size=4, **CONST)
    d = plan.derive()
    link = d.links["tp"]
    assert link.collectives == ()
    act = 2 * GPT.seq_length * GPT.hidden
    for name in coll.COLLECTIVES:                      # every collective on the link's pair
        steps, share = coll.factors(name, 4)
        assert coll.collective_time(name, act, 4, link) == pytest.approx(
            steps * 2.9e-4 + share * act / 1.1e9, rel=1e-12)
    # the same plan on the same figures given without a file: the same step, to the bit
    same = plan.with_(cluster=plan.cluster.with_(hardware=Hardware(**{**old, "name": "x"})))
    assert pipesim.simulate(same).step_time == pipesim.simulate(plan).step_time
    assert (d.costs.dp_latency, d.costs.dp_bandwidth) == (2.9e-4, 1.1e9)
