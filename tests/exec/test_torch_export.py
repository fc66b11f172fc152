"""Schedules exported to torch.distributed.pipelining's CSV (with their communication) run right
in torch's own ``_PipelineScheduleRuntime``: one step on gloo gives the gradients of a single
process, every parameter of every stage (fp32, rtol 1e-5). pipesim's receives, posted right
before their consumers, break torch's one-channel-per-pair matching in the V placement (ZB-V at
pp = 2: torch runs it without an error and returns wrong gradients); the export orders them for
it, and the test shows both.
"""
from __future__ import annotations

import os
import tempfile

import pytest
import torch

import pipesim
from pipeexec import launch
from pipesim.schedule.io import schedule_to_csv

pytestmark = pytest.mark.slow

LAYERS, HIDDEN, SEQ, VOCAB, B = 6, 16, 8, 32, 1      # 8 layers with embedding and head


def spec():
    from pipeexec.config import GPT_MODEL
    from pipeexec.model import gpt_stack

    return gpt_stack(GPT_MODEL.with_(layers=LAYERS, hidden=HIDDEN, heads=2, seq_length=SEQ,
                                     vocab=VOCAB))


def batch(m: int):
    from pipeexec.data import BatchSource

    return BatchSource(seed=0, seq_len=SEQ, vocab=VOCAB, global_batch=m * B).global_batch_at(0)


def stage_modules(num_stages: int, stages):
    from pipeexec.partition import by_layers
    from pipeexec.pipeline.stage import build_stage

    sp = spec()
    bounds = by_layers(sp.num_layers, num_stages)
    return {s: build_stage(sp, s, bounds, seed=0, device=torch.device("cpu"), dtype=torch.float32)
            for s in stages}


def reference_grads(num_stages: int, m: int) -> dict:
    """Single process: the whole model, the sum of the microbatch losses. (torch scales a
    pipeline's gradients by 1/m in the REDUCE_GRAD actions that its own lowering of a
    compute-only schedule adds; a "compute_comms" CSV has none, so they stay unscaled.)"""
    mods = stage_modules(num_stages, range(num_stages))
    x, y = batch(m)
    loss = 0.0
    for xs, ys in zip(x.chunk(m), y.chunk(m)):
        h = xs
        for s in range(num_stages):
            h = mods[s](h)
        loss = loss + spec().loss_fn(h, ys)
    loss.backward()
    return {(s, n): p.grad.clone() for s, mod in mods.items() for n, p in mod.named_parameters()}


def torch_worker(board, pp: int, cases: list[tuple[str, int, int, str]]) -> dict:
    """Run each (label, vpp, m, CSV text) for one step in torch's runtime; return the grads."""
    import torch.distributed.pipelining as tpp
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    from pipeexec.topology import destroy_topology, init_topology

    topo = init_topology(pp, 1, timeout=60)
    out = {}
    try:
        for label, vpp, m, text in cases:
            s = pipesim.schedule_from_csv(text)
            mine = [st for st in range(s.num_stages) if s.stage_rank(st) == topo.pp_rank]
            mods = stage_modules(s.num_stages, mine)
            stages = [tpp.PipelineStage(mods[st], st, s.num_stages, torch.device("cpu"),
                                        group=topo.pp_group) for st in mine]
            sched = _PipelineScheduleRuntime(stages, n_microbatches=m, loss_fn=spec().loss_fn)
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "s.csv")
                with open(path, "w") as f:
                    f.write(text)
                sched._load_csv(path, format="compute_comms")
            x, y = batch(m)
            kwargs = {"target": y, "losses": []} if s.num_stages - 1 in mine else {}
            if 0 in mine:
                sched.step(x, **kwargs)
            else:
                sched.step(**kwargs)
            out[label] = {(st, n): p.grad.clone() for st, mod in mods.items()
                          for n, p in mod.named_parameters()}
    finally:
        destroy_topology(topo)
    return out


def raw_csv(s: pipesim.Schedule) -> str:
    """The old export: pipesim's inserted receives as they stand (right before the consumer)."""
    return "".join(",".join(str(a) for a in s.actions(r)) + "\n" for r in range(s.pp))


CASES = {2: [("zbv", 2, 4), ("dualpipev", 2, 4), ("interleaved", 2, 4), ("1f1b", 1, 4),
             ("v-half", 2, 4)],
         4: [("zbv", 2, 8), ("dualpipev", 2, 8)]}


@pytest.mark.parametrize("pp", sorted(CASES))
def test_exported_schedules_give_single_process_gradients_in_torch(pp):
    cases = []
    for name, vpp, m in CASES[pp]:
        s = pipesim.build_schedule(name, pp=pp, vpp=vpp, microbatches=m)
        cases.append((name, vpp, m, schedule_to_csv(s, with_comms=True)))
    broken = pipesim.build_schedule("zbv", pp=2, vpp=2, microbatches=4)
    if pp == 2:
        with pytest.raises(pipesim.ScheduleError, match="matches untagged messages"):
            broken.validate(single_channel=True)
        cases.append(("zbv, receives as inserted", 2, 4, raw_csv(broken)))
    results = launch(torch_worker, pp, (pp, cases), timeout=300)
    for name, vpp, m, _ in cases:
        ref = reference_grads(pp * vpp, m)
        got = {k: v for r in results for k, v in r[name].items()}
        assert got.keys() == ref.keys(), name
        worst = max((got[k] - ref[k]).abs().max().item() for k in ref)
        if name.endswith("as inserted"):
            assert worst > 1e-3, f"{name}: expected torch to pair the wrong tensors"
            continue
        for k in ref:
            torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6,
                                       msg=lambda msg: f"{name} pp={pp} stage {k}: {msg}")
