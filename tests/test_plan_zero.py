"""ZeRO in a plan's costs, as pipeexec runs it (`pipeexec.training.zero`), ZeRO-2/3 reducing
once a microbatch (``grad_reduce="per_microbatch"``; once a step, the default, is
tests/test_plan_grad_reduce.py's):

* ZeRO-1 reduce-scatters the gradients once a step, in the tail, then all-gathers the weights;
* ZeRO-2 reduce-scatters them once a microbatch, as every backward makes them (pipeexec: a
  bucket, a layer, at a time inside each B or W): the program's REDUCE_GRAD after every B
  carries the reduce-scatter (``costs.reduce_grad``, a layer's collective a unit), its tail only
  the weights' all-gather, so with m microbatches it moves m times ZeRO-1's gradient bytes;
  F / I / W are ZeRO-1's;
* ZeRO-3 also gathers the weights before each computation (``costs.unshard``): its tail has no
  data-parallel traffic; its transient (two gathered layers: weights and gradients) at the
  precision's bytes.
"""
import pytest

import pipesim
from pipesim.plan import collectives as coll
from pipesim.plan.footprint import BYTES_PER_PARAM
from pipesim.plan.model import ModelSpec

GPT = ModelSpec("gpt", 16, 2048, 16, 1024, 51200)


def plan(zero: int, precision: str = "bf16") -> pipesim.Plan:
    return pipesim.Plan.create(GPT, "H100", dp=8, tp=2, pp=2, global_batch_size=64, zero=zero,
                               precision=precision, overlap_grad_reduce=False,
                               overlap_param_gather=False, grad_reduce="per_microbatch")


def test_zero2_reduce_scatters_every_microbatch_in_the_backward_not_once_in_the_tail():
    z0, z1, z2 = (plan(z).derive() for z in (0, 1, 2))
    net = z1.links["dp"]
    m = plan(2).parallelism.microbatches
    assert m == 8
    layer = sum(GPT.layer_params().values()) / 2            # a block's parameters on a tp rank
    rs = coll.reduce_scatter(4 * layer, 8, net)             # its fp32 gradients, once
    for r, layers in enumerate(z2.stage_layers):
        params = sum(z2.stage_params[r].values())
        # the tail: ZeRO-1 reduce-scatters and gathers, ZeRO-2 only gathers (bf16 weights)
        assert z1.tail[r].dp_comm == pytest.approx(coll.reduce_scatter(4 * params, 8, net)
                                                   + coll.all_gather(2 * params, 8, net))
        assert z2.tail[r].dp_comm == pytest.approx(coll.all_gather(2 * params, 8, net))
        # W: nobody's adds anything; ZeRO-2's REDUCE_GRAD is every block's reduce-scatter and
        # the rest of the stage's (embedding, head) as one unit more
        w0, w1, w2 = (d.costs.backward_weight[r] for d in (z0, z1, z2))
        assert w1 == w0 == w2
        rest = params - layers * layer
        assert z2.costs.reduce_grad[r] == pytest.approx(
            layers * rs + coll.reduce_scatter(4 * rest, 8, net), rel=1e-12)
    # the program reduces after every B: over a step ZeRO-2 moves about m times ZeRO-1's tail
    # reduce-scatter
    result = pipesim.simulate(plan(2))
    reduces = result.trace[result.trace["op"] == "REDUCE_GRAD"]
    assert reduces.groupby("stage").size().tolist() == [m, m]
    per_step = sum(m * z2.costs.reduce_grad[r] for r in range(2))
    tail_rs = sum(z1.tail[r].dp_comm - z2.tail[r].dp_comm for r in range(2))
    assert per_step > (m - 1) * tail_rs
    assert result.step_time > pipesim.simulate(plan(1)).step_time


def test_zero3_has_no_tail_traffic_and_its_transient_follows_the_precision():
    for precision in ("bf16", "fp32", "fp16"):
        d = plan(3, precision).derive()
        assert all(t.dp_comm == 0 for t in d.tail), precision
        w, g, _ = BYTES_PER_PARAM[precision]
        largest = sum(GPT.layer_params().values()) / 2
        assert d.rank_buffers[0] == pytest.approx(2 * largest * (w + g)), precision
        # the weights gathered for each computation by the program's UNSHARD, not in F
        z2 = plan(2, precision).derive()
        assert d.costs.forward == z2.costs.forward
        params = sum(d.stage_params[1].values())
        layers = d.stage_layers[1]
        net = d.links["dp"]
        assert d.costs.unshard[1] == pytest.approx(
            layers * coll.all_gather(w * largest, 8, net)
            + coll.all_gather(w * (params - layers * largest), 8, net), rel=1e-12), precision
