"""Collectives as NCCL runs them on the GPU presets: its tuner's algorithm and protocol (NVIDIA/nccl
src/graph/tuning.cc, commit 5067397, its constants transcribed by hand below), rail-aligned
rings across nodes on every NIC of a node, all-to-all's off-node share on the NICs, and each
group priced from where Megatron's rank order places its members (8-GPU nodes, NVL72 racks).
Published figures: nccl-tests on 8 H100s (NCCL's maintainer, NVIDIA/nccl-tests#212: ring bus
bandwidth ~370 GB/s, NVLS ~480 GB/s) and on DGX A100s across nodes (NVIDIA, NVIDIA/nccl#812:
192 GB/s with 8 x 200 Gbit/s NICs)."""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

import pytest

import pipesim
from pipesim.hardware import get_hardware
from pipesim.plan import collectives as coll
from pipesim.plan.cluster import Cluster, group_placement
from pipesim.plan.model import ModelSpec
from pipesim.plan.parallelism import Parallelism

GPT = ModelSpec("gpt", 16, 2048, 16, 1024, 51200)
GB = 1e9
H100_BUS = 450e9 * 0.824            # SM90_NVLINK_BW 20.6 of 25 GB/s a link, 18 links: 370.8 GB/s
A100_BUS = 300e9 * 0.80             # SM80_NVLINK_BW 20.0 of 25, 12 links: 240 GB/s
NIC_400 = 50e9 * 0.96               # NET_BW 12 GB/s a 100 Gbit/s: 48 GB/s a 400 Gbit/s NIC
NIC_200 = 25e9 * 0.96


def busbw(name: str, n: float, p: int, t: float) -> float:
    """nccl-tests' bus bandwidth of a collective's time (its README's factors)."""
    return (2 * (p - 1) / p if name == "all_reduce" else (p - 1) / p) * n / t


def h100(**kw) -> Cluster:
    return Cluster(get_hardware("H100"), **kw)


# -- inside one node -------------------------------------------------------------------------
def test_a_ring_inside_a_node_is_nccls_ring_simple_closed_form():
    link = h100().intra()
    assert (link.arch, link.nvls, link.nvlinks) == ("hopper", True, 18)
    assert link.bandwidth == pytest.approx(H100_BUS)
    n = 256 * 2**20
    # 4 ranks: NVLS's graph has 4 channels of 60 GB/s (240 <= 370.8): 2 x .85 x 240 x 3/4 =
    # 306 GB/s bus < the ring's 370.8, so the ring, Simple: base 8.4 us + 6 steps x 3.4 us
    ring = (8.4 + 6 * 3.4) * 1e-6 + n * 6 / 4 / H100_BUS
    choice = coll.nccl_choice("all_reduce", n, 4, link)
    assert (choice.algorithm, choice.protocol) == ("ring", "Simple")
    assert coll.all_reduce(n, 4, link) == pytest.approx(ring, rel=1e-12)
    # all-gather: p - 1 steps, the ring's bus bandwidth at (p - 1) / p of the bytes
    assert coll.all_gather(n, 4, link) == pytest.approx((8.4 + 3 * 3.4) * 1e-6 + n * 3 / 4 / H100_BUS)
    # without NVLS (nccl-tests' NCCL_ALGO=RING) 8 H100s reach the ~370 GB/s NCCL's maintainer quotes
    big = 8 * 2**30
    ring8 = coll.nccl_choice("all_reduce", big, 8, replace(link, nvls=False))
    assert busbw("all_reduce", big, 8, ring8.seconds) == pytest.approx(370 * GB, rel=0.01)


def test_nvls_on_eight_h100s_reaches_the_published_480_gbs():
    link = h100().intra()
    n = 8 * 2**30
    # NVLS graph: 8 channels of 40 GB/s (8 x 50 > 370.8); bus 2 x .85 x 320 x 7/8 = 476 GB/s,
    # latency 25 us (hwLatencies NVLINK, NVLS Simple), algorithm bandwidth x 8 / 14
    bus = 2 * 0.85 * 320e9 * 7 / 8
    t = 25e-6 + n * 14 / 8 / bus
    choice = coll.nccl_choice("all_reduce", n, 8, link)
    assert (choice.algorithm, choice.protocol) == ("nvls", "Simple")
    assert choice.seconds == pytest.approx(t, rel=1e-12)
    assert busbw("all_reduce", n, 8, t) == pytest.approx(480 * GB, rel=0.02)   # nccl-tests#212
    # A100 has no NVLink SHARP: its ring
    assert coll.nccl_choice("all_reduce", n, 8, Cluster(get_hardware("A100")).intra()).algorithm == "ring"


def test_small_messages_take_ll_then_ll128_then_simple():
    link = h100().intra()
    sizes = [2**k for k in range(6, 34)]
    protos = [coll.nccl_choice("all_gather", n, 8, link).protocol for n in sizes]
    order = {"LL": 0, "LL128": 1, "Simple": 2}
    assert [order[p] for p in protos] == sorted(order[p] for p in protos)
    assert protos[0] == "LL" and protos[-1] == "Simple" and "LL128" in protos
    # 4 KiB all-gather over 8: LL, 6.6 us + 7 x 0.6 us, bus min(llMaxBw 141, 370.8 / 2) GB/s
    n = 4096
    assert coll.all_gather(n, 8, link) == pytest.approx((6.6 + 7 * 0.6) * 1e-6 + n * 7 / 8 / 141e9)


# -- across nodes ------------------------------------------------------------------------------
def test_a_ring_across_nodes_runs_on_every_nic_its_members_have():
    a100 = Cluster(get_hardware("A100"))
    # 16 ranks on 2 DGX A100s, 8 a node: 8 NICs of 200 Gbit/s, 192 GB/s (NVIDIA's figure)
    wide = a100.group_links(Parallelism(dp=16))["dp"]
    assert (wide.kind, wide.nodes, wide.per_domain) == ("inter", 2, 8)
    assert wide.bandwidth == pytest.approx(min(A100_BUS, 8 * NIC_200)) == pytest.approx(192 * GB)
    # tp 8: each data-parallel group has one member a node, one NIC
    one = a100.group_links(Parallelism(tp=8, dp=2))["dp"]
    assert (one.per_domain, one.bandwidth) == (1, pytest.approx(NIC_200))
    # tp 2: four members a node, four NICs
    assert a100.group_links(Parallelism(tp=2, dp=8))["dp"].bandwidth == pytest.approx(4 * NIC_200)
    # a ring across 2 nodes: 30 steps, 2 of them across (14 us, NET ring Simple), the rest
    # 3.4 us, x 1.4 (the plateau); NCCL's tree on 2 nodes: NVLink's 240 x .92 x .5 = 110 GB/s
    # beats the ring's 192 x 16 / 30 = 102 GB/s (as NCCL's maintainer says it picks there)
    n = 2**30
    ring = 1.4 * (8.4 + 28 * 3.4 + 2 * 14.0) * 1e-6 + n * 30 / 16 / (192 * GB)
    tree = (8.4 + 2 * (7 * 4.0 + 1 * 14.0)) * 1e-6 + n / (A100_BUS * 0.92 * 0.5)
    choice = coll.nccl_choice("all_reduce", n, 16, wide)
    assert (choice.algorithm, choice.protocol) == ("tree", "Simple")
    assert choice.seconds == pytest.approx(min(ring, tree), rel=1e-12) and tree < ring
    # one member a node over 64 nodes: the tree for small messages, the ring for large
    far = h100().group_links(Parallelism(tp=8, dp=64))["dp"]
    assert (far.nodes, far.per_domain, far.bandwidth) == (64, 1, pytest.approx(NIC_400))
    assert coll.nccl_choice("all_reduce", 64 * 2**10, 64, far).algorithm == "tree"
    assert coll.nccl_choice("all_reduce", 2**30, 64, far).algorithm == "ring"
    big = 2**30           # every step a network hop: 14 us (one rank a node: NET tree Simple)
    assert coll.all_reduce(big, 64, far) == pytest.approx(
        1.4 * (8.4 + 126 * 14.0) * 1e-6 + big * 126 / 64 / NIC_400, rel=1e-12)


def test_an_all_to_all_across_nodes_sends_only_the_off_node_share_over_the_network():
    hw = get_hardware("H100")
    link = h100().group_links(Parallelism(dp=16, ep=16))["ep"]     # 8 members a node
    assert (link.nodes, link.per_domain) == (2, 8)
    n = 64 * 2**20
    on = 7 * hw.link_latency + 7 / 16 * n / H100_BUS               # 7 peers over NVLink
    off = 8 * hw.network_latency + 8 / 16 * n / NIC_400            # 8 peers, the own NIC
    assert coll.all_to_all(n, 16, link) == pytest.approx(max(on, off), rel=1e-12)
    # one node: the ring convention on NVLink, as before
    inside = h100().group_links(Parallelism(dp=8, ep=8))["ep"]
    assert coll.all_to_all(n, 8, inside) == pytest.approx(7 * hw.link_latency + 7 / 8 * n / H100_BUS)


def test_a_pipeline_send_across_nodes_takes_one_gpus_nics():
    links = h100().group_links(Parallelism(pp=16))                 # 8 stages a node
    assert links["pp"].kind == "inter"
    assert links["pp"].bandwidth == pytest.approx(NIC_400)


# -- NVLink domains ----------------------------------------------------------------------------
def _brute(stride: int, size: int, world: int, domain: int) -> tuple[int, int]:
    """Every group of Megatron's order, its members' domains counted one by one."""
    worst = None
    for r in range(world):
        if (r // stride) % size:
            continue                                # not a group's first member
        members = [r + i * stride for i in range(size)]
        counts = Counter(m // domain for m in members)
        key = (len(counts) > 1, -min(counts.values()), len(counts))
        if worst is None or key > worst[0]:
            worst = (key, (len(counts), min(counts.values())))
    return worst[1]


@pytest.mark.parametrize("domain, world", [(8, 64), (72, 144), (72, 288), (8, 48)])
def test_group_placement_matches_every_group_counted_one_by_one(domain, world):
    for stride in (1, 2, 3, 4, 6, 8, 16):
        for size in (2, 3, 4, 8, 9, 16, 32):
            if world % (stride * size):
                continue
            assert group_placement(stride, size, world, domain) == _brute(
                stride, size, world, domain), (stride, size, world, domain)


def test_groups_on_nvl72_are_priced_from_where_their_members_are():
    gb = Cluster(get_hardware("GB200"))
    assert gb.domain == 72
    # dp 32 at stride tp 4 spans 128 GPUs: 18 members in one rack, 14 in the next
    assert group_placement(4, 32, 128, 72) == (2, 14)
    dp = gb.group_links(Parallelism(tp=4, dp=32))["dp"]
    nic = get_hardware("GB200").network_bandwidth * 0.96
    assert (dp.kind, dp.nodes, dp.per_domain) == ("inter", 2, 14)
    assert dp.bandwidth == pytest.approx(min(900e9 * 0.802, 14 * nic))
    # dp 9 at stride 8: 72, one rack exactly: NVLink (and NVLS there)
    inside = gb.group_links(Parallelism(tp=8, dp=9, pp=2))["dp"]
    assert (inside.kind, inside.nvls) == ("intra", True)
    # tp 16 on 144 GPUs: 72 is no multiple of 16, the fifth group straddles two racks
    assert group_placement(1, 16, 144, 72) == (2, 8)
    assert gb.group_links(Parallelism(tp=16, pp=9))["tp"].kind == "inter"
    # the same tp 16 on 8-GPU nodes: two nodes, 8 a node
    assert h100().group_links(Parallelism(tp=16, pp=9))["tp"].per_domain == 8


def test_a_plan_on_nvl72_pays_for_the_rack_its_data_parallel_group_leaves():
    one = pipesim.Plan.create(GPT, "GB200", tp=8, dp=9, global_batch_size=9,
                              overlap_grad_reduce=False, overlap_param_gather=False)
    two = one.with_(tp=4, dp=18, global_batch_size=18)
    d1, d2 = one.derive(), two.derive()
    assert d1.links["dp"].kind == "intra"
    assert d2.links["dp"].kind == "intra"          # dp 18 at stride 4 spans 72: one rack
    three = one.with_(tp=4, dp=32, global_batch_size=32)
    d3 = three.derive()
    assert d3.links["dp"].kind == "inter" and d3.links["dp"].per_domain == 14
    params = sum(d3.stage_params[0].values())
    assert d3.tail[0].dp_comm == pytest.approx(coll.all_reduce(4 * params, 32, d3.links["dp"]))


# -- measured figures and files ----------------------------------------------------------------
def test_a_measured_file_keeps_its_own_figures_and_the_tuner_class_round_trips(tmp_path):
    cpu = get_hardware("tests/data/cpu_2core_hardware.json")
    assert cpu.nccl_arch == "" and "nccl_arch" not in cpu.to_dict()
    link = Cluster(cpu).intra()
    assert link.arch == ""
    lat, bw = link.figure("all_reduce", 2)
    assert coll.all_reduce(1e6, 2, link) == pytest.approx(2 * lat + 1e6 / bw, rel=1e-12)
    # a preset's class goes to its file and back; a wrong one is refused by name
    hw = get_hardware("H200")
    assert hw.to_dict()["nccl_arch"] == "hopper" and "tuning.cc" in hw.source("nccl_arch")
    path = tmp_path / "h200.json"
    hw.save(path)
    assert get_hardware(str(path)) == hw
    for bad in ("volta", 1, True):
        path.write_text(json.dumps({**hw.to_dict(), "nccl_arch": bad}))
        with pytest.raises(ValueError, match="nccl_arch must be one of"):
            get_hardware(str(path))
    # measured per-collective figures on a preset win over the tuner
    measured = hw.with_(collectives=(("intra", "all_reduce", 0, 1e-5, 1e11),))
    link = Cluster(measured).intra()
    assert link.arch == "hopper"
    assert coll.all_reduce(1e8, 8, link) == pytest.approx(14 * 1e-5 + 14 / 8 * 1e8 / 1e11)
    # an overridden link is the plain ring
    plain = Cluster(hw, intra_bandwidth=100e9, intra_latency=1e-6).intra()
    assert plain.arch == "" and coll.all_reduce(1e8, 8, plain) == pytest.approx(
        14e-6 + 14 / 8 * 1e8 / 100e9)


def test_the_benchmark_prints_the_model_beside_the_published_figures(capsys):
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).parent.parent / "benchmarks" / "bench_nccl_model.py"
    spec = importlib.util.spec_from_file_location("bench_nccl_model", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main() == 0
    out = capsys.readouterr().out
    assert "summary: 9 published points" in out
    rows = [ln for ln in out.splitlines() if "NVIDIA/nccl-tests#212" in ln]
    assert len(rows) == 3 and all(0.98 <= float(ln.split()[-2]) <= 1.02 for ln in rows)
