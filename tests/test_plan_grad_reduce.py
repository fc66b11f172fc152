"""When ZeRO-2/3 reduce the gradients (``parallelism.grad_reduce``) and in which dtype
(``parallelism.grad_reduce_in_fp32``), each priced from closed forms:

* ``per_step`` (the default; Megatron-LM's DDP holds the reduction with ``no_sync`` until the
  last microbatch, megatron/core/distributed/distributed_data_parallel.py, and its buckets start
  it from ``register_grad_ready`` only when ``is_last_microbatch``, param_and_grad_buffer.py):
  the whole gradient buffer held through the step, one reduce-scatter of it a step: the
  program's REDUCE_GRAD after each stage's last backward, in Megatron's DDP buckets
  (``max(40M, 1M * dp)`` parameters on the first rank's first stage, the stage at once
  elsewhere: `pipesim.plan.derive.megatron_buckets`), streamed with that backward down to the
  last bucket; nothing in W nor in the tail. So ZeRO-2 holds exactly what
  ZeRO-1 does (Megatron's distributed-optimizer row, 6 + 12/d bytes a parameter in bf16), and
  ZeRO-3 ZeRO-1 less the weights' (d - 1)/d;
* ``per_microbatch`` (DeepSpeed's ZeRO stage 2: gradients reduced as the backward makes them,
  each rank keeping its partition): the shard held, plus one bucket (a layer's gradients) while
  it fills, the same REDUCE_GRAD after every backward (m a step), none in the tail;
* ZeRO-3 gathers each stage's weights, a layer a unit, before every computation (UNSHARD);
* 16-bit gradients (``grad_reduce_in_fp32=False``, Megatron-LM's ``--grad-reduce-in-bf16``):
  2 bytes a parameter in the buffer and on the wire, the optimizer's fp32 copy of its shard's
  gradients 4 more: Megatron's fp16 row (20, or 4 + 16/d distributed).
"""
import json
import math

import pytest

import pipesim
from pipesim.errors import PlanError
from pipesim.plan import collectives as coll
from pipesim.plan.footprint import bytes_per_param, param_bytes
from pipesim.plan.model import ModelSpec
from pipesim.plan.flags import BY_DEST
from pipesim.plan.parallelism import Parallelism

GPT = ModelSpec("gpt", 16, 2048, 16, 1024, 51200)
D = 8


def plan(zero: int, grad_reduce: str = "per_step", **kw) -> pipesim.Plan:
    base = dict(dp=D, tp=2, pp=4, global_batch_size=64)
    base.update(kw)
    return pipesim.Plan.create(GPT, "H100", zero=zero, grad_reduce=grad_reduce, **base)


def layer_params() -> float:
    return sum(GPT.layer_params().values()) / 2               # a block on one of 2 tp ranks


def test_the_default_is_once_a_step_and_zero2_then_costs_what_zero1_does():
    assert Parallelism().grad_reduce == "per_step"
    z1, z2 = plan(1).derive(), plan(2).derive()
    assert z1.stage_memory == z2.stage_memory
    # the same reduce-scatter a step: ZeRO-1's in the tail, ZeRO-2's in its REDUCE_GRAD actions
    # (a layer a message: NCCL's per-message cost makes them a little dearer, never cheaper);
    # the weights' all-gather in the tail for both
    net = z1.links["dp"]
    for r in range(4):
        n = sum(z2.stage_params[r].values())
        rs, ag = coll.reduce_scatter(4 * n, D, net), coll.all_gather(2 * n, D, net)
        assert z1.tail[r].dp_comm == pytest.approx(rs + ag, rel=1e-12)
        assert z2.tail[r].dp_comm == pytest.approx(ag, rel=1e-12)
        assert rs * (1 - 1e-9) <= z2.costs.reduce_grad[r] < 1.1 * rs
    assert z1.costs.backward_weight == z2.costs.backward_weight
    assert z1.rank_buffers == z2.rank_buffers == [0.0] * 4
    # Megatron's distributed optimizer, bf16 with fp32 gradients: 6 + 12/d bytes a parameter
    for r, m in enumerate(z2.stage_memory):
        n = sum(z2.stage_params[r].values())
        assert sum(m.values()) == pytest.approx((6 + 12 / D) * n, rel=1e-12)


@pytest.mark.parametrize("zero", [2, 3])
def test_memory_whole_buffer_per_step_shard_plus_bucket_per_microbatch(zero):
    step, micro = plan(zero).derive(), plan(zero, "per_microbatch").derive()
    lp = layer_params()
    for r in range(4):
        n = sum(step.stage_params[r].values())
        assert step.stage_memory[r]["gradients"] == pytest.approx(4 * n, rel=1e-12)
        assert micro.stage_memory[r]["gradients"] == pytest.approx(4 * n / D, rel=1e-12)
        assert step.stage_memory[r]["optimizer"] == micro.stage_memory[r]["optimizer"] \
            == pytest.approx(12 * n / D, rel=1e-12)
        weights = 2 * n / (D if zero == 3 else 1)
        assert step.stage_memory[r]["weights"] == pytest.approx(weights, rel=1e-12)
    if zero == 2:      # per step nothing transient; per microbatch one layer's bucket, fp32
        assert step.rank_buffers == [0.0] * 4
        assert micro.rank_buffers == pytest.approx([4 * lp] * 4, rel=1e-12)
    else:              # two gathered layers: their weights, and per microbatch their gradients
        assert step.rank_buffers == pytest.approx([2 * lp * 2] * 4, rel=1e-12)
        assert micro.rank_buffers == pytest.approx([2 * lp * (2 + 4)] * 4, rel=1e-12)


def test_communication_once_in_the_tail_or_once_per_layer_per_microbatch():
    """No overlap: the tail is the closed form (the weights' all-gather); a middle stage's
    reduction is, once a step, one reduce-scatter of its whole buffer (Megatron without
    overlap_grad_reduce: one bucket), once a microbatch its layers' (the program's REDUCE_GRAD
    actions), its W the plain one."""
    kw = dict(overlap_grad_reduce=False, overlap_param_gather=False)
    z0, step, micro = (plan(0, **kw).derive(), plan(2, **kw).derive(),
                       plan(2, "per_microbatch", **kw).derive())
    net = step.links["dp"]
    m = plan(2).parallelism.microbatches
    assert m == 8
    rs_layer = coll.reduce_scatter(4 * layer_params(), D, net)
    for r in range(4):
        n = sum(step.stage_params[r].values())
        ag = coll.all_gather(2 * n, D, net)
        for d in (step, micro):                         # the reduction is the actions'
            assert d.tail[r].dp_comm == pytest.approx(ag, rel=1e-12)
            assert d.tail[r].dp_exposed == pytest.approx(ag, rel=1e-12)
            assert d.costs.backward_weight[r] == z0.costs.backward_weight[r]
    for r in (1, 2):                                   # no embedding, no head: layers only
        layers = step.stage_layers[r]
        rs_stage = coll.reduce_scatter(4 * layers * layer_params(), D, net)
        assert step.costs.reduce_grad[r] == pytest.approx(rs_stage, rel=1e-12)
        assert micro.costs.reduce_grad[r] == pytest.approx(layers * rs_layer, rel=1e-12)
        for d in (step, micro):
            # not streamed without the overlap: after the backward, a stage at once
            assert d.costs.stage_values("reduce_grad_units", 4)[r] == 1.0
    # per step the reduce-scatter runs once a stage, per microbatch m times
    for p, per_stage in ((plan(2, **kw), 1), (plan(2, "per_microbatch", **kw), m)):
        trace = pipesim.simulate(p).trace
        counts = trace[trace["op"] == "REDUCE_GRAD"].groupby("stage").size()
        assert counts.tolist() == [per_stage] * 4


def test_once_a_step_overlaps_with_the_last_backward_down_to_the_last_bucket():
    """The REDUCE_GRAD after a stage's last B streams its units, Megatron's buckets (the first
    stage's ``ceil(P / 40M)`` at dp 8, one on the other ranks), with that B: it starts once the
    B made its first unit's gradients, ends one unit's reduction after the B at the soonest,
    and the rank's step ends with it; the tail keeps the weights' all-gather, overlapped with
    the next forward."""
    p = plan(2)
    d = p.derive()
    net = d.links["dp"]
    costs = d.costs
    hw = p.cluster.hardware
    u = hw.network_processor_usage if net.kind == "inter" else hw.link_processor_usage
    result = pipesim.simulate(p)
    t = result.trace
    for r in range(4):
        n = sum(d.stage_params[r].values())
        ag = coll.all_gather(2 * n, D, net)
        # all but the link's processor usage u of the gather hides under the next forward
        # (Calculon's model, pipesim.plan.overlap), or shows where it outlasts it
        exposed = ag - costs.forward[r] if ag * (1 - u) > costs.forward[r] else ag * u
        assert d.tail[r].dp_exposed == pytest.approx(exposed, rel=1e-12)
        units = math.ceil(n / 40e6) if r == 0 else 1
        assert costs.reduce_grad_units[r] == units
        assert costs.reduce_grad[r] == pytest.approx(
            units * coll.reduce_scatter(4 * n / units, D, net), rel=1e-12)
        last_b = t[(t["rank"] == r) & (t["op"] == "B")].iloc[-1]
        reduce = t[(t["rank"] == r) & (t["op"] == "REDUCE_GRAD")]
        assert len(reduce) == 1
        rg = costs.reduce_grad[r]
        start = last_b["start"] + (last_b["end"] - last_b["start"]) / units
        assert reduce["start"].item() == pytest.approx(start, rel=1e-12)
        assert reduce["end"].item() == pytest.approx(max(start + rg, last_b["end"] + rg / units),
                                                     rel=1e-12)
        assert result.sim.rank_end[r] == pytest.approx(reduce["end"].item(), rel=1e-12)
        assert result.rank_step_time[r] == pytest.approx(
            reduce["end"].item() + exposed + d.tail[r].optimizer, rel=1e-12)


def test_zero3_gathers_each_layer_in_f_and_again_in_i_every_microbatch():
    """The program gathers a stage before each of its F and B (1F1B: an F and a B a
    microbatch), its layers' all-gathers; F / I / W are ZeRO-0's and the tail carries no
    data-parallel traffic (no all-gather: the weights are gathered per action; the reduction
    is REDUCE_GRAD's)."""
    z0, z3 = plan(0).derive(), plan(3).derive()
    ag = coll.all_gather(2 * layer_params(), D, z3.links["dp"])
    assert z3.costs.forward == z0.costs.forward
    assert z3.costs.backward_input == z0.costs.backward_input
    for r in (1, 2):
        layers = z3.stage_layers[r]
        assert z3.costs.unshard[r] == pytest.approx(layers * ag, rel=1e-12)
        assert z3.costs.unshard_units[r] == layers
    m = plan(3).parallelism.microbatches
    trace = pipesim.simulate(plan(3)).trace
    assert trace[trace["op"] == "UNSHARD"].groupby("stage").size().tolist() == [2 * m] * 4
    for grad_reduce in ("per_step", "per_microbatch"):
        assert all(t.dp_comm == 0 for t in plan(3, grad_reduce).derive().tail)


def test_sixteen_bit_gradients_are_megatrons_fp16_row_and_halve_the_traffic():
    """Megatron-LM docs/source/api-guide/dist_optimizer.md: 20 bytes a parameter, 4 + 16/d
    distributed, when the gradients are 16-bit."""
    for d in (1, 2, 8, 64):
        per = bytes_per_param(Parallelism(grad_reduce_in_fp32=False))
        assert per == (2, 2, 16)
        assert sum(param_bytes("bf16", 0, 1.0, 0.0, d, d, per_param=per).values()) == 20
        assert sum(param_bytes("bf16", 1, 1.0, 0.0, d, d, per_param=per).values()) == \
            pytest.approx(4 + 16 / d)
    # the defaults: Megatron-LM's arguments.py makes bf16 reduce in fp32, fp16 in fp16
    assert bytes_per_param(Parallelism()) == (2, 4, 12)
    assert bytes_per_param(Parallelism(precision="fp16")) == (2, 2, 16)
    assert bytes_per_param(Parallelism(precision="fp16", grad_reduce_in_fp32=True)) == (2, 4, 12)
    assert bytes_per_param(Parallelism(precision="fp32")) == (4, 4, 8)
    fp32, half = plan(1).derive(), plan(1, grad_reduce_in_fp32=False).derive()
    net = fp32.links["dp"]
    for r in range(4):
        n = sum(fp32.stage_params[r].values())
        assert half.tail[r].dp_comm == pytest.approx(coll.reduce_scatter(2 * n, D, net)
                                                     + coll.all_gather(2 * n, D, net), rel=1e-12)
        assert half.stage_memory[r]["gradients"] == pytest.approx(2 * n, rel=1e-12)
        assert half.stage_memory[r]["optimizer"] == pytest.approx(16 * n / D, rel=1e-12)


def test_plan_files_carry_the_fields_and_old_ones_load_with_the_defaults(tmp_path):
    p = plan(2, "per_microbatch", grad_reduce_in_fp32=False)
    path = tmp_path / "plan.json"
    p.to_json(str(path))
    back = pipesim.Plan.from_json(str(path))
    assert back.parallelism.grad_reduce == "per_microbatch"
    assert back.parallelism.grad_reduce_in_fp32 is False
    data = json.loads(path.read_text())
    del data["parallelism"]["grad_reduce"], data["parallelism"]["grad_reduce_in_fp32"]
    path.write_text(json.dumps(data))
    old = pipesim.Plan.from_json(str(path))
    assert old.parallelism.grad_reduce == "per_step"
    assert old.parallelism.grad_reduce_in_fp32 is None and old.parallelism.grads_fp32


@pytest.mark.parametrize("field, value, words", [
    ("grad_reduce", "sometimes", "per_step, per_microbatch"),
    ("grad_reduce", 1, "per_step"),
    ("grad_reduce_in_fp32", "yes", "true, false or null"),
    ("grad_reduce_in_fp32", 1, "true, false or null"),
])
def test_bad_values_name_the_field(field, value, words):
    with pytest.raises(PlanError, match=f"parallelism.{field}") as err:
        Parallelism(**{field: value})
    assert words in str(err.value)
    with pytest.raises(PlanError, match="grad_reduce_in_fp32.*fp32"):
        Parallelism(precision="fp32", grad_reduce_in_fp32=False)


def test_the_flags_set_the_fields():
    import argparse

    from pipesim.plan.flags import add_plan_flags, apply_flags, given_dests

    parser = argparse.ArgumentParser()
    add_plan_flags(parser)
    argv = ["--grad-reduce", "per_microbatch", "--no-grad-reduce-in-fp32"]
    ns = parser.parse_args(argv)
    out = apply_flags(plan(2), ns, given_dests(parser, argv))
    assert out.parallelism.grad_reduce == "per_microbatch"
    assert out.parallelism.grad_reduce_in_fp32 is False
    assert BY_DEST["grad_reduce"].choices == ("per_step", "per_microbatch")
    with pytest.raises(SystemExit):
        parser.parse_args(["--grad-reduce", "sometimes"])


def test_llama3_405b_at_the_papers_layout_term_by_term():
    """Llama 3 405B as Meta trained it at 8k (Grattafiori et al. 2024, Table 4: tp 8, pp 16,
    dp 128 on 16,384 H100s, micro batch 1, 16M tokens a batch; §3.3.2: interleaved, one layer
    a model chunk, the first chunk only the embedding and the last only the head, so vpp 8),
    no recomputation, gradients reduced once a step in fp32. A middle pipeline rank holds,
    exactly: its 8 layers' weights (2 bytes a parameter), their whole fp32 gradient buffer (4),
    the optimizer's shard (12 / 128), and the activations of every one of its 8 x 16
    (layer, microbatch) pairs: with m = pp = 16 microbatches, interleaved 1F1B's warmup
    (2 (pp - r - 1) + (vpp - 1) pp forwards, Megatron's) runs every forward before the first
    backward (and one posted receive buffer). 81.7 GiB: over an 80 GB H100, the activations
    alone 63.6 GiB."""
    from pipesim.plan.footprint import layer_activations
    from pipesim.plan.model import PRESETS

    model = PRESETS["llama3-405b"].with_(seq_length=8192)
    p = pipesim.Plan.create(model, "H100", schedule="interleaved", tp=8, pp=16, vpp=8, dp=128,
                            sequence_parallel=True, micro_batch_size=1,
                            global_batch_size=2048, zero=2, first_stage_layers=0,
                            last_stage_layers=0)
    assert p.stage_layers() == [0] + [1] * 126 + [0]
    m = p.parallelism.microbatches
    assert m == 16
    r = pipesim.simulate(p)
    mid = r.memory_breakdown[1]
    n = 8 * sum(model.layer_params().values()) / 8           # 8 layers on one of 8 tp ranks
    assert mid["weights"] == pytest.approx(2 * n, rel=1e-12)
    assert mid["gradients"] == pytest.approx(4 * n, rel=1e-12)
    assert mid["optimizer"] == pytest.approx(12 * n / 128, rel=1e-12)
    act = layer_activations(model, p.parallelism).total
    recv = p.costs().p2p_bytes                # the one receive buffer posted at the peak
    assert mid["activations"] == pytest.approx(8 * m * act + recv, rel=1e-12)
    gib = 2 ** 30
    assert (mid["weights"] / gib, mid["gradients"] / gib, mid["activations"] / gib) == \
        pytest.approx((5.94, 11.88, 63.59), abs=0.01)
    assert not r.fits
    # 16-bit gradients save the gradients' half; sharding them (once a microbatch) all but
    # the shard and one bucket: 71.4 GiB, under the 72.4 GiB usable
    half = pipesim.simulate(p.with_(grad_reduce_in_fp32=False)).memory_breakdown[1]
    assert half["gradients"] == pytest.approx(2 * n, rel=1e-12)
    micro = pipesim.simulate(p.with_(grad_reduce="per_microbatch"))
    assert micro.memory_breakdown[1]["gradients"] == pytest.approx(4 * n / 128, rel=1e-12)
    assert micro.fits


def test_a_search_that_finds_nothing_names_the_gradient_knobs():
    from pipesim.planner.enumerate import SearchSpace
    from pipesim.planner.hints import narrowed_hints

    hints = " | ".join(narrowed_hints(SearchSpace("llama3-8b", 16, 32)))
    assert "--grad-reduce per_microbatch" in hints and "--no-grad-reduce-in-fp32" in hints
    sharded = " | ".join(narrowed_hints(SearchSpace("llama3-8b", 16, 32, zero=(0, 1),
                                                    grad_reduce_in_fp32=False)))
    assert "--grad-reduce" not in sharded and "--no-grad-reduce-in-fp32" not in sharded


def test_megatron_buckets_once_a_step_layers_for_fsdp():
    """Megatron-Core's DDP (megatron/core/distributed/distributed_data_parallel.py) cuts a
    chunk's gradient buffer into buckets of ``max(40M, 1M * dp)`` parameters, on the first
    pipeline rank's first chunk only (training.py: later chunks and pp ranks > 0 get one
    bucket), one bucket without overlap_grad_reduce: ZeRO-2 once a step (its distributed
    optimizer) takes those units; ZeRO-3 (FSDP) gathers and reduces a layer at a time."""
    from pipesim.plan.derive import megatron_buckets

    assert megatron_buckets(150e6, 8) == 4 == math.ceil(150e6 / 40e6)
    assert megatron_buckets(150e6, 64) == 3 == math.ceil(150e6 / 64e6)     # 1M * dp above 40M
    assert megatron_buckets(150e6, 64, first_chunk=False) == 1
    assert megatron_buckets(150e6, 64, overlap_grad_reduce=False) == 1
    assert megatron_buckets(10e6, 8) == 1 and megatron_buckets(0.0, 8) == 1
    for dp in (8, 64):
        p = plan(2, dp=dp, global_batch_size=8 * dp)
        d = p.derive()
        n = [sum(d.stage_params[r].values()) for r in range(4)]
        assert d.costs.reduce_grad_units[0] == math.ceil(n[0] / max(40e6, 1e6 * dp))
        assert list(d.costs.reduce_grad_units[1:]) == [1.0, 1.0, 1.0]
        z3 = plan(3, dp=dp, global_batch_size=8 * dp).derive()      # FSDP: a layer a unit
        for r in range(4):
            layers = z3.stage_layers[r] + (r in (0, 3))              # embedding, head
            assert z3.costs.reduce_grad_units[r] == z3.costs.unshard_units[r] == layers
        micro = plan(2, "per_microbatch", dp=dp, global_batch_size=8 * dp).derive()
        assert list(micro.costs.reduce_grad_units) == list(z3.costs.reduce_grad_units)
