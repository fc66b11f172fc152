"""Context and expert parallelism priced as pipeexec runs them, against closed forms written
out by hand for a small model: cp's ``all_gather`` (K/V gathered in F, gathered again with the
attention recomputed and dK/dV reduce-scattered in I, all exposed; the gathered K/V a
transient), the ring's ``p2p`` as before (overlapped with the attention), ep's two
all-to-alls per MoE layer in F and I, the expert gradients over dp * cp / ep, and every one of
these collectives at a hardware file's measured figure for that collective and group size."""
from __future__ import annotations

import pytest

import pipesim
from pipesim.plan.cluster import Cluster
from pipesim.errors import PlanError
from pipesim.hardware import get_hardware
from pipesim.plan.footprint import layer_activations
from pipesim.plan.model import ModelSpec
from pipesim.plan.parallelism import Parallelism

# b = 1, s = 128, h = 64, q = 64 (4 heads of 16), kv = 32 (2 kv heads), GeLU ffn 256, fp32
TINY = ModelSpec("tiny", layers=2, hidden=64, heads=4, kv_heads=2, seq_length=128, vocab=256,
                 tied_embeddings=False, dropout=False, vocab_divisible_by=1)
# per collective, p = 2: (latency, bandwidth), each its own and none the link's pair
FIG = {"all_gather": (11e-6, 0.9e9), "reduce_scatter": (23e-6, 0.7e9),
       "all_reduce": (31e-6, 1.1e9), "all_to_all": (43e-6, 0.3e9)}


def hardware():
    rows = tuple(("intra", name, 2, lat, bw) for name, (lat, bw) in FIG.items())
    return get_hardware("H100").with_(name="measured", calibration="measured", collectives=rows)


def ring(name: str, n: float, p: int = 2) -> float:
    """The ring convention by hand at FIG's figure: (p-1) a + (p-1)/p n / B (all-reduce x2)."""
    lat, bw = FIG[name]
    k = 2 if name == "all_reduce" else 1
    return k * (p - 1) * lat + k * (p - 1) / p * n / bw


def plan(model=TINY, **par):
    par = {"cp": 2, "pp": 2, "precision": "fp32", **par}
    return pipesim.Plan(model, Parallelism(**par), Cluster(hardware()), "1f1b",
                        efficiency=0.5)


# one layer on one cp rank (s / cp = 64 tokens): GEMMs G = 2T h (q + 2kv) + 2T q h + 2 * 2T h f
# at T = 64, causal attention A = 4 b (s/cp) s q / 2 (the ring's, skipping masked blocks; the
# all-gather's explicit mask computes all of them, 2A); K and V of the whole sequence in fp32
G = 2 * 64 * 64 * 128 + 2 * 64 * 64 * 64 + 2 * 2 * 64 * 64 * 256
A = 4 * 64 * 128 * 64 / 2
KV = 2 * 4 * 128 * 32


def test_all_gather_cp_charges_the_gather_the_regather_the_recompute_and_the_reduce_scatter():
    p = plan(cp_comm="all_gather")
    rate = p.cluster.hardware.fp32_peak_flops * 0.5
    g, a = G / rate, 2 * A / rate
    d = p.derive()
    c = d.costs
    # stage 0: one layer (the embedding: no FLOPs in the constant model, no tp collective)
    assert c.forward[0] == pytest.approx(g + a + ring("all_gather", KV), rel=1e-12)
    assert c.backward_input[0] == pytest.approx(
        g + 2 * a + a + ring("all_gather", KV) + ring("reduce_scatter", KV), rel=1e-12)
    assert c.backward_weight[0] == pytest.approx(g, rel=1e-12)
    sc = d.stage_comm[0]
    assert sc["F"]["cp"] == pytest.approx(ring("all_gather", KV))
    assert sc["I"]["cp"] == pytest.approx(ring("all_gather", KV) + ring("reduce_scatter", KV))
    assert sc["F"]["tp"] == sc["F"]["ep"] == 0.0
    # per microbatch, the whole pipeline: two layers' F and I
    assert d.comm["cp"] == pytest.approx(2 * (2 * ring("all_gather", KV)
                                              + ring("reduce_scatter", KV)))
    # memory: the gathered K/V and their gradients, transient, on each pipeline rank
    assert d.rank_buffers == [pytest.approx(2 * KV)] * 2
    assert list(c.static_bytes) == d.rank_buffers


def test_p2p_cp_is_the_ring_overlapped_with_the_attention_as_before():
    p = plan()                       # the default: Megatron's p2p ring
    assert p.parallelism.cp_comm == "p2p"
    rate = p.cluster.hardware.fp32_peak_flops * 0.5
    g, a = G / rate, A / rate
    c = p.derive().costs
    ag = ring("all_gather", KV)
    assert c.forward[0] == pytest.approx(g + a + max(0.0, ag - a), rel=1e-12)
    assert c.backward_input[0] == pytest.approx(g + 2 * a + max(0.0, ag - 2 * a), rel=1e-12)
    assert p.derive().rank_buffers == [0.0, 0.0]
    # the all-gather is never cheaper than the ring
    assert plan(cp_comm="all_gather").derive().costs.backward_input[0] > c.backward_input[0]


def test_all_gather_cp_keeps_only_q_k_v_of_the_attention():
    # Korthikanti at s/cp = 64, fp32, no dropout: norms' and QKV/MLP inputs 4e sbh, Q K V
    # e s(q + 2kv), the projection's input e s q, GeLU 2e s f; the core (flash: the fp32
    # log-sum-exp 4 a s b) only with the ring
    sbh = 64 * 64
    kept = 4 * 4 * sbh + 4 * 64 * 128 + 4 * 64 * 64 + 2 * 4 * 64 * 256
    ag = plan(cp_comm="all_gather").parallelism
    assert layer_activations(TINY, ag).total == kept
    assert layer_activations(TINY, Parallelism(cp=2, precision="fp32")).total == kept + 4 * 4 * 64
    # and without flash attention the s/cp x s scores are not kept either
    assert layer_activations(TINY, ag.with_(flash_attention=False)).total == kept


def test_all_gather_cp_under_full_recomputation_gathers_in_the_recomputed_forward_too():
    d = plan(cp_comm="all_gather", recompute="full").derive()
    ag, rs = ring("all_gather", KV), ring("reduce_scatter", KV)
    assert d.stage_comm[0]["I"]["cp"] == pytest.approx(ag + (ag + rs))
    base = plan(cp_comm="all_gather").derive().costs
    assert d.costs.backward_input[0] == pytest.approx(base.backward_input[0] + base.forward[0])


def test_cp_comm_is_checked_and_round_trips_in_a_plan_file():
    with pytest.raises(PlanError, match=r"cp_comm: 'ring' is not one of p2p, all_gather"):
        Parallelism(cp_comm="ring")
    with pytest.raises(PlanError, match="a2a.*not modelled"):
        Parallelism(cp_comm="a2a")
    p = plan(cp_comm="all_gather")
    assert pipesim.Plan.from_json(p.to_json()).parallelism.cp_comm == "all_gather"
    assert "cp=2(all_gather)" in p.parallelism.short()
    # cp 1: nothing is exchanged either way
    one = plan(cp=1, cp_comm="all_gather").derive()
    assert one.comm["cp"] == 0.0 and one.rank_buffers == [0.0, 0.0]
    assert one.costs.forward == plan(cp=1).derive().costs.forward


def test_the_per_operator_attention_under_all_gather_cp_computes_every_masked_block():
    from pipesim.plan.operators import layer_ops

    def flash(**par):
        ops = layer_ops(TINY, Parallelism(cp=2, precision="fp32", **par))
        return next(o for o in ops if o.name == "flash_attention").flops
    assert flash() == A and flash(cp_comm="all_gather") == 2 * A


# -- expert parallelism -----------------------------------------------------------------------
# a Mixtral-like tiny MoE: 4 experts, top-2, SwiGLU experts of 128, RMSNorm, no biases, rotary
MOE = ModelSpec("tiny-moe", layers=2, hidden=64, heads=4, kv_heads=2, seq_length=128, vocab=256,
                mlp="swiglu", norm="rmsnorm", position="rotary", bias=False,
                tied_embeddings=False, dropout=False, vocab_divisible_by=1, experts=4, top_k=2,
                moe_ffn_hidden=128)


def test_ep_prices_dispatch_and_combine_all_to_alls_in_f_and_i_and_the_expert_grads():
    p = plan(MOE, cp=1, dp=2, ep=2)
    rate = p.cluster.hardware.fp32_peak_flops * 0.5
    T, h, k = 128, 64, 2
    # attention GEMMs + top-2 of the SwiGLU experts (3 matrices); causal attention
    g = (2 * T * h * 128 + 2 * T * 64 * h + k * 3 * 2 * T * h * 128) / rate
    a = 4 * 128 * 128 * 64 / 2 / rate
    # each token's k copies of h fp32 values sent out (dispatch) and back (combine); F first
    # exchanges the 4 experts' int64 token counts (the variable splits)
    a2a = 2 * ring("all_to_all", T * k * h * 4)
    counts = ring("all_to_all", 8 * 4)
    d = p.derive()
    assert d.costs.forward[0] == pytest.approx(g + a + a2a + counts, rel=1e-12)
    assert d.costs.backward_input[0] == pytest.approx(g + 2 * a + a2a, rel=1e-12)
    assert d.stage_comm[0]["F"]["ep"] == pytest.approx(a2a + counts)
    assert d.stage_comm[0]["I"]["ep"] == pytest.approx(a2a)
    # a rank holds half the experts; their gradients are reduced over dp * cp / ep = 1 rank
    experts = 4 * 3 * h * 128
    dense = (h * (64 + 2 * 32) + 64 * h) + 2 * h + h * 4          # attention, 2 norms, router
    assert d.stage_params[0] == {"dense": pytest.approx(dense + 256 * h),   # + the embedding
                                 "expert": pytest.approx(experts / 2)}
    assert d.tail[0].dp_comm == pytest.approx(ring("all_reduce", 4 * (dense + 256 * h)))
    # at ep 1 every rank holds all four experts and all-reduces them over dp = 2 too (their
    # own reduction, as at any ep: the expert-data-parallel group)
    one = plan(MOE, cp=1, dp=2, ep=1).derive()
    assert one.stage_comm[0]["F"]["ep"] == 0.0
    assert one.tail[0].dp_comm == pytest.approx(ring("all_reduce", 4 * (dense + 256 * h))
                                                + ring("all_reduce", 4 * experts))


def test_ep_over_dp_x_cp_and_the_dispatched_tokens_kept():
    # ep 2 carved out of cp 2 (dp 1): the tokens a cp rank holds (s / cp) are dispatched
    d = plan(MOE, cp=2, dp=1, ep=2, cp_comm="all_gather").derive()
    assert d.stage_comm[0]["I"]["ep"] == pytest.approx(2 * ring("all_to_all", 64 * 2 * 64 * 4))
    assert d.stage_params[0]["expert"] == pytest.approx(4 * 3 * 64 * 128 / 2)
    # kept per MoE layer (fp32, s/cp = 64, no dropout): norms' and inputs 4e sbh, Q K V and the
    # projection's input, and per routed copy its dispatched input e sbh and SwiGLU's 3e sf
    s, e = 64, 4
    kept = (4 * e * s * 64 + e * s * (64 + 2 * 32) + e * s * 64
            + 2 * (e * s * 64 + 3 * e * s * 128))
    assert layer_activations(MOE, plan(MOE, cp=2, ep=2, cp_comm="all_gather").parallelism,
                             moe=True).total == kept


def test_a_calibrate_hardware_file_prices_cp_and_ep_at_its_measured_figures():
    """The file ``pipeexec calibrate-hardware`` wrote on the development VM: cp's all-gather and
    reduce-scatter and ep's all-to-all at that file's own figure for each at p = 2, not its
    link pair (fitted to the all-reduce)."""
    import json
    from pathlib import Path

    path = Path(__file__).parent / "data" / "cpu_2core_hardware.json"
    hw = get_hardware(str(path))
    figures = json.loads(path.read_text())["collectives"]["intra"]

    def at(name: str, n: float) -> float:
        f = figures[name]["2"]
        return f["latency"] + 0.5 * n / f["bandwidth"]
    cluster = Cluster(hw)
    d = pipesim.Plan(TINY, Parallelism(cp=2, pp=2, precision="fp32", cp_comm="all_gather"),
                     cluster, "1f1b").derive()
    assert d.stage_comm[0]["F"]["cp"] == pytest.approx(at("all_gather", KV), rel=1e-12)
    assert d.stage_comm[0]["I"]["cp"] == pytest.approx(
        at("all_gather", KV) + at("reduce_scatter", KV), rel=1e-12)
    assert at("all_gather", KV) != pytest.approx(hw.link_latency + 0.5 * KV / hw.link_bandwidth)
    d = pipesim.Plan(MOE, Parallelism(dp=2, ep=2, pp=2, precision="fp32"), cluster,
                     "1f1b").derive()
    assert d.stage_comm[0]["I"]["ep"] == pytest.approx(2 * at("all_to_all", 128 * 2 * 64 * 4),
                                                        rel=1e-12)


# -- Megatron's flex dispatcher (DeepEP / HybridEP) and its EP overlap -------------------------
def test_the_flex_dispatcher_sends_a_token_once_to_each_rank_holding_its_experts():
    """4 experts, top 2, ep 2 (2 experts a rank): a token misses a rank's 2 experts with
    chance C(2, 2) / C(4, 2) = 1/6, so it goes to 5/6 of the ranks, p * 5/6 = 5/3 copies of
    its h fp32 values in the all-to-all's convention (the all-to-all dispatcher: k = 2)."""
    from math import comb

    from pipesim.plan import collectives as coll

    assert coll.miss(4, 2, 2) == pytest.approx(comb(2, 2) / comb(4, 2))
    assert coll.miss(256, 64, 8) == pytest.approx(comb(192, 8) / comb(256, 8))
    assert coll.miss(8, 7, 2) == 0.0
    T, h = 128, 64
    base = plan(MOE, cp=1, dp=2, ep=2).derive()
    flex = plan(MOE, cp=1, dp=2, ep=2, ep_dispatcher="deepep").derive()
    counts = ring("all_to_all", 8 * 4)
    assert flex.stage_comm[0]["I"]["ep"] == pytest.approx(
        2 * ring("all_to_all", 2 * 5 / 6 * T * h * 4), rel=1e-12)
    assert flex.stage_comm[0]["F"]["ep"] == pytest.approx(
        2 * ring("all_to_all", 2 * 5 / 6 * T * h * 4) + counts, rel=1e-12)
    assert flex.costs.forward[0] - base.costs.forward[0] == pytest.approx(
        flex.stage_comm[0]["F"]["ep"] - base.stage_comm[0]["F"]["ep"], rel=1e-9)
    # one expert a rank: a token's k experts are k ranks, the all-to-all's k copies
    one = ModelSpec("tiny-moe2", layers=2, hidden=64, heads=4, kv_heads=2, seq_length=128,
                    vocab=256, mlp="swiglu", norm="rmsnorm", position="rotary", bias=False,
                    tied_embeddings=False, dropout=False, vocab_divisible_by=1, experts=2,
                    top_k=1, moe_ffn_hidden=128)
    assert plan(one, cp=1, dp=2, ep=2, ep_dispatcher="deepep").derive().stage_comm[0]["I"]["ep"] \
        == pytest.approx(plan(one, cp=1, dp=2, ep=2).derive().stage_comm[0]["I"]["ep"])


def test_the_flex_dispatcher_crosses_the_network_once_a_remote_domain():
    """DeepSeek-V3's ep 32 over four 8-GPU nodes (256 experts, top 8): over the NICs, the 3
    remote nodes each hit with chance 1 - C(192, 8) / C(256, 8) (DeepEP's normal kernels:
    RDMA once a node, NVLink inside it), against the all-to-all dispatcher's 8 * 24/32 = 6
    copies; over NVLink, the 7 other local ranks each hit with 1 - C(248, 8) / C(256, 8);
    the slower of the two, each one message latency (one kernel writes to every peer). In
    one domain: one latency and the copies to the p - 1 other ranks over NVLink."""
    from math import comb

    from pipesim.plan import collectives as coll
    from pipesim.plan.cluster import Link

    link = Link("inter", latency=5e-6, bandwidth=45e9, nodes=4, per_domain=8,
                local_latency=2e-6, local_bandwidth=700e9, nic_bandwidth=45e9)
    n = 4096 * 7168 * 2                            # one microbatch's tokens, bf16
    remote = 3 * (1 - comb(192, 8) / comb(256, 8))
    local = 7 * (1 - comb(248, 8) / comb(256, 8))
    want = max(2e-6 + local * n / 700e9, 5e-6 + remote * n / 45e9)
    assert coll.flex_dispatch(n, 8, 256, 32, link) == pytest.approx(want, rel=1e-12)
    assert remote == pytest.approx(2.71, abs=0.005)
    nvl = Link("intra", latency=2e-6, bandwidth=700e9)
    assert coll.flex_dispatch(n, 8, 256, 64, nvl) == pytest.approx(
        2e-6 + 63 * (1 - comb(252, 8) / comb(256, 8)) * n / 700e9, rel=1e-12)
    assert coll.all_to_all(8 * n, 32, link) == pytest.approx(
        max(7 * 2e-6 + 7 / 32 * 8 * n / 700e9, 24 * 5e-6 + 24 / 32 * 8 * n / 45e9))


def test_ep_overlap_hides_the_exchanges_under_the_layers_compute_at_its_processor_cost():
    """Megatron's overlap_moe_expert_parallel_comm: the F and I exchanges of a MoE layer
    (2 x dispatch + combine, and F's counts) run under the layer's F + I + W of another
    microbatch: what shows is Calculon's added(comm, window, u), u the NVLink processor
    usage, split between F and I as the exchanges are; the pipeline's warmup forwards and
    cooldown backwards (pp / m of them) have no partner and show their exchanges whole."""
    from pipesim.plan.overlap import added

    T, h, k = 128, 64, 2
    p = plan(MOE, cp=1, dp=2, ep=2, pp=2, global_batch_size=16)      # m = 8
    rate = p.cluster.hardware.fp32_peak_flops * 0.5
    g = (2 * T * h * 128 + 2 * T * 64 * h + k * 3 * 2 * T * h * 128) / rate
    a = 4 * 128 * 128 * 64 / 2 / rate
    a2a = 2 * ring("all_to_all", T * k * h * 4)
    counts = ring("all_to_all", 8 * 4)
    d = plan(MOE, cp=1, dp=2, ep=2, pp=2, global_batch_size=16, overlap_ep_comm=True).derive()
    u = p.cluster.hardware.link_processor_usage
    paired = added(2 * a2a + counts, (g + a) + (g + 2 * a) + g, u)
    assert paired == pytest.approx(2 * a2a + counts - (3 * g + 3 * a))  # too long: the excess
    shown = 0.75 * paired + 0.25 * (2 * a2a + counts)                    # 2 of 8 alone
    # stage 1 holds the second MoE layer and the head; stage 0 the first and the embedding
    base = p.derive()
    assert d.costs.forward[0] - base.costs.forward[0] == pytest.approx(
        shown * (a2a + counts) / (2 * a2a + counts) - (a2a + counts), rel=1e-9)
    assert d.costs.backward_input[0] - base.costs.backward_input[0] == pytest.approx(
        shown * a2a / (2 * a2a + counts) - a2a, rel=1e-9)
    assert d.stage_comm[0] == base.stage_comm[0]          # the exchange itself is unchanged


def test_ep_overlap_leaves_megatrons_warmup_and_cooldown_unpaired():
    """Megatron-Core's schedules.py (get_pp_rank_microbatches): with the EP overlap an
    interleaved rank r warms up with 2 (pp - r - 1) + (vpp - 1) pp + 1 of its m vpp forwards
    (at most all), and without pipelining the first forward runs alone: the unpaired
    fraction, averaged over the ranks."""
    from pipesim.plan.derive import ep_overlap_unpaired

    def megatron(pp, vpp, m):
        if pp == 1:
            return 1 / m
        warm = [min(m * vpp, 2 * (pp - r - 1) + (vpp - 1) * pp + 1) for r in range(pp)]
        return sum(warm) / (pp * m * vpp)

    for pp, vpp, m in ((1, 1, 5), (1, 1, 64), (8, 2, 128), (8, 4, 512), (4, 12, 64),
                       (2, 8, 256), (16, 2, 64)):
        assert ep_overlap_unpaired(pp, m) == pytest.approx(megatron(pp, vpp, m), rel=1e-12)
    assert ep_overlap_unpaired(8, 4) == 1.0               # every step is warmup or cooldown


def test_ep_dispatcher_is_checked_and_both_knobs_round_trip_in_a_plan_file(tmp_path):
    with pytest.raises(PlanError, match="parallelism.ep_dispatcher: 'flex' is not one of "
                                        "alltoall, deepep, hybridep"):
        Parallelism(ep=2, dp=2, ep_dispatcher="flex")
    p = plan(MOE, cp=1, dp=2, ep=2, ep_dispatcher="deepep", overlap_ep_comm=True)
    path = tmp_path / "plan.json"
    p.to_json(path)
    back = pipesim.Plan.from_json(path)
    assert back.parallelism.ep_dispatcher == "deepep" and back.parallelism.overlap_ep_comm
    assert "ep=2(deepep)+overlap" in back.parallelism.short()


def test_the_dispatchers_permute_the_routed_copies_as_megatron_does():
    """Megatron's token_dispatcher.py: DeepEP permutes the k routed copies for the experts and
    back (2 passes, each a read and a write of T k h); the all-to-all dispatcher also sorts
    the received chunks by local expert and back (4, with more than one expert a rank);
    HybridEP permutes inside its dispatch and combine kernels (0)."""
    from pipesim.plan.operators import layer_ops

    T, k, h, e = 128, 2, 64, 4
    def permute(**par):
        ops = layer_ops(MOE, Parallelism(precision="fp32", **par), moe=True)
        return sum(o.bytes for o in ops if o.name == "permute")
    assert permute(dp=2, ep=2, ep_dispatcher="deepep") == 2 * 2 * e * T * k * h
    assert permute(dp=2, ep=2) == 4 * 2 * e * T * k * h          # 2 experts a rank: sorted
    assert permute(dp=4, ep=4) == 2 * 2 * e * T * k * h          # 1 expert a rank: no sort
    assert permute(dp=2, ep=1) == 2 * 2 * e * T * k * h
    assert permute(dp=2, ep=2, ep_dispatcher="hybridep") == 0


def test_expert_gradients_reduce_over_their_own_group_on_its_members_nics():
    """64 B200s, 8 a node, dp 64, ep 8 (EP folded innermost over dp): the ranks holding the
    same experts are 8 apart, one a node: their reduce-scatter and gather run on one GPU's
    NIC (the network's bus bandwidth of one GPU), not on the dense group's 8 GPUs a node."""
    from pipesim.plan import collectives as coll

    p = pipesim.Plan.create("qwen3-30b-a3b", "B200", dp=64, ep=8, global_batch_size=64,
                            ep_dispatcher="deepep", grad_reduce_in_fp32=False, zero=1)
    links = p.cluster.group_links(p.parallelism)
    edp, dp = links["edp"], links["dp"]
    hw = p.cluster.hardware
    nic = hw.network_bandwidth * hw.network_bus_efficiency
    assert (edp.nodes, edp.per_domain, edp.bandwidth) == (8, 1, pytest.approx(nic))
    assert (dp.nodes, dp.per_domain) == (8, 8)
    d = p.derive()
    dense, expert = d.stage_params[0]["dense"], d.stage_params[0]["expert"]
    want = (coll.reduce_scatter(2 * dense, 64, dp) + coll.reduce_scatter(2 * expert, 8, edp)
            + coll.all_gather(2 * dense, 64, dp) + coll.all_gather(2 * expert, 8, edp))
    assert d.tail[0].dp_comm == pytest.approx(want, rel=1e-12)
    # ep 64 (one expert group over all): nothing left to reduce the experts over
    assert pipesim.Plan.create("qwen3-30b-a3b", "B200", dp=64, ep=64, global_batch_size=64
                               ).cluster.group_links(Parallelism(dp=64, ep=64))["edp"].nodes == 1
