"""ZeRO-2/3 run the gradient reduction the plan names (``grad_reduce``,
`pipeexec.training.zero`), pp 2 x dp 2 (4 forked gloo ranks), 1F1B, 2 steps:

* ``per_step`` (the default, Megatron's): the microbatches accumulate in the whole fp32
  buffer and each stage's buckets are reduce-scattered once, after the stage's last backward:
  one reduce-scatter a bucket a step; ``per_microbatch`` (DeepSpeed's stage 2): after every
  backward, m a step (the counts pipesim prices: tests/test_plan_grad_reduce.py);
* both equal single-process training on the whole batch: the losses, every parameter and the
  logged gradient norm (fp32, rtol 1e-5, as tests/exec/test_exec_equivalence.py);
* each rank's measured peak of held bytes (`TrainingMemoryMeter`: activations and training
  state) within 1% of the plan's prediction (`predicted_peaks`) under each: per step the whole
  fp32 gradient buffer (ZeRO-1's), per microbatch its shard, ``4 n (1 - 1/d)`` bytes fewer for
  a rank's ``n`` parameters (the bucket filling inside a backward is gone when the meter reads,
  after the action).
"""
from __future__ import annotations

import functools

import pytest
import torch

from pipeexec import launch
from pipeexec.analysis.plan_memory import predicted_peaks
from pipeexec.measuring.memory import TrainingMemoryMeter
from pipeexec.topology import destroy_topology, init_topology
from pipeexec.training.train import train
from pipeexec.run.assemble import assemble

from exec_helpers import GLOBAL_BATCH, MICROBATCHES, TINY, layout_config, reference_train
from test_exec_equivalence import merged_params

STEPS = 2
CASES = [(z, r) for z in (2, 3) for r in ("per_step", "per_microbatch")]


def config(zero: int, grad_reduce: str):
    return layout_config("1f1b", 2, 2, zero=zero, grad_reduce=grad_reduce, steps=STEPS)


def worker(board):
    topo = init_topology(2, 2, device="cpu", timeout=120)
    out = {"pp_rank": topo.pp_rank}
    try:
        for zero, reduce in CASES:
            cfg = config(zero, reduce)
            t = assemble(cfg, topo, board=board)
            params = [p for st in t.stages.values() for p in st.parameters()]
            meter = TrainingMemoryMeter(t.runtime, t.state_tensors, exclude=params)
            t.add_stage_hooks(meter)
            t.add_observer(meter)
            res = train(t)
            out[(zero, reduce)] = {
                "losses": res.losses, "norms": res.grad_norms, "peak": meter.peak,
                "dp_rank": topo.dp_rank, "n": sum(p.numel() for p in params),
                "reduce_scatters": t.sharded.reduce_scatters,
                "buckets": sum(len(lay.buckets) for lay in t.sharded.layouts.values()),
                "microbatches": cfg.plan.microbatches,
                "params": {n: p.detach().clone() for n, p in t.named_parameters().items()}}
    finally:
        destroy_topology(topo)
    return out


@functools.lru_cache(maxsize=None)
def runs():
    return launch(worker, 4, (), timeout=600)


@functools.lru_cache(maxsize=None)
def single_process():
    norms: list[float] = []
    cfg = TINY.with_flat(microbatches=MICROBATCHES, micro_batch_size=GLOBAL_BATCH // MICROBATCHES,
                         steps=STEPS)
    losses, params, _ = reference_train(cfg, norms=norms)
    return losses, params, norms


@pytest.mark.parametrize("zero,grad_reduce", CASES)
def test_equals_one_process_losses_parameters_and_grad_norm(zero, grad_reduce):
    results = runs()
    key = (zero, grad_reduce)
    ref_losses, ref_params, ref_norms = single_process()
    for r in results:
        torch.testing.assert_close(torch.tensor(r[key]["losses"]), torch.tensor(ref_losses),
                                   rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.tensor(r[key]["norms"]), torch.tensor(ref_norms),
                                   rtol=1e-5, atol=0)
    params = merged_params(results, key, 2)
    assert params.keys() == ref_params.keys()
    for n in ref_params:
        torch.testing.assert_close(params[n], ref_params[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("zero", [2, 3])
def test_once_a_step_or_once_a_microbatch(zero):
    for r in runs():
        step, micro = r[(zero, "per_step")], r[(zero, "per_microbatch")]
        assert step["reduce_scatters"] == step["buckets"]
        assert micro["reduce_scatters"] == step["microbatches"] * micro["buckets"]


@pytest.mark.parametrize("zero,grad_reduce", CASES)
def test_measured_peak_matches_the_plan(zero, grad_reduce):
    predicted = predicted_peaks(config(zero, grad_reduce))
    for r in runs():
        got = r[(zero, grad_reduce)]["peak"]
        assert predicted[r["pp_rank"]] == pytest.approx(got, rel=0.01), (zero, grad_reduce)


@pytest.mark.parametrize("zero", [2, 3])
def test_once_a_step_holds_the_whole_buffer_once_a_microbatch_the_shard(zero):
    for r in runs():
        step, micro = r[(zero, "per_step")], r[(zero, "per_microbatch")]
        assert step["peak"] - micro["peak"] == pytest.approx(4 * step["n"] * (1 - 1 / 2),
                                                             rel=0.02)
