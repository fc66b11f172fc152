"""Data parallelism's gradient scale, seen where it shows: AdamW with global-norm clipping
cancels a uniform scale of the gradients (a sum over dp instead of the average moves neither
losses nor parameters), but the logged gradient norm, the clipping threshold and fp16's
overflow check see it. 2 ranks (dp 2), a few steps, against the single-process reference
(`exec_helpers.reference_run`: plain torch, the whole global batch): the gradient norm of
every step (rtol 1e-5), with the losses and parameters, for plain data parallelism and ZeRO
1, 2 (a tied embedding, whose gradients ZeRO >= 2 reduce apart) and 3; and once, with
clipping off, the averaged gradients themselves."""
from __future__ import annotations

import functools

import pytest
import torch

from pipeexec import launch
from pipeexec.topology import destroy_topology, init_topology
from pipeexec.training.train import train
from pipeexec.run.assemble import assemble

from exec_helpers import assert_grad_norms, layout_config, reference_run

CASES = [({},), ({"clip_grad": 0.0, "steps": 1},), ({"zero": 1},),
         ({"zero": 2, "tie_embeddings": True},), ({"zero": 3, "steps": 2},)]


def _key(changes: dict) -> tuple:
    return tuple(sorted(changes.items()))


def grads_worker(board, cases: list[dict]) -> dict:
    """Per case: losses, gradient norms, parameters and (without ZeRO) the last step's
    reduced gradients by name."""
    topo = init_topology(1, 2, device="cpu", timeout=120)
    out = {}
    try:
        for changes in cases:
            cfg = layout_config("1f1b", 1, 2, **changes)
            trainer = assemble(cfg, topo, board=board)
            res = train(trainer)
            grads = ({} if trainer.sharded is not None else
                     {n: m.grad.clone() for n, m in zip(trainer.param_names,
                                                          trainer.masters.masters)})
            out[_key(changes)] = {"config": cfg, "losses": res.losses,
                                  "grad_norms": res.grad_norms, "grads": grads,
                                  "params": {n: p.detach().clone()
                                             for n, p in trainer.named_parameters().items()}}
    finally:
        destroy_topology(topo)
    return out


@functools.lru_cache(maxsize=None)
def runs():
    return launch(grads_worker, 2, ([c for c, in CASES],), timeout=300)


@pytest.mark.parametrize("changes", [c for c, in CASES],
                         ids=["ddp", "ddp-grads", "zero1", "zero2-tied", "zero3"])
def test_data_parallel_gradients_are_the_single_process_average(changes):
    results = runs()
    key = _key(changes)
    cfg = results[0][key]["config"]
    ref = reference_run(cfg)
    # the norms must be above the clip threshold or clipping is never exercised
    if cfg.optimizer.clip_grad:
        assert min(ref.grad_norms) > cfg.optimizer.clip_grad
    for r in results:
        entry = r[key]
        assert_grad_norms(entry["grad_norms"], ref.grad_norms, f"{changes} rank")
        torch.testing.assert_close(torch.tensor(entry["losses"]), torch.tensor(ref.losses),
                                   rtol=1e-5, atol=0)
        assert entry["params"].keys() == ref.params.keys() or cfg.plan.model.tied_embeddings
        for n, p in ref.params.items():
            torch.testing.assert_close(entry["params"][n], p, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{changes}: {n}: {m}")
        if entry["grads"] and not cfg.optimizer.clip_grad:
            # clipping off: the buffer holds the step's averaged gradient as reduced
            for n, g in ref.grads[-1].items():
                torch.testing.assert_close(entry["grads"][n], g, rtol=1e-5, atol=1e-7,
                                           msg=lambda m: f"{changes}: gradient of {n}: {m}")
