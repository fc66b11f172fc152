"""Context parallelism (`--cp`) equals one process.

Each sequence is cut into 2 cp chunks, rank i holding chunks i and 2 cp - 1 - i
(`pipeexec.parallel.context`); K/V are all-gathered over the cp group inside each attention
(its backward: reduce-scatter of dK/dV), the loss is each cp rank's token mean averaged over
cp, and the gradients are averaged over dp x cp. Checked here:

* single process: the load-balanced chunking and its inverse, the causal mask at the global
  positions, and what does not cut refused before any process starts;
* cp 2 x pp 2 (4 forked gloo ranks, one launch): the built-in GPT under 1F1B, ZB-V (also with
  NCCL's matching emulated: cp's collectives on their own communicators), interleaved,
  DualPipeV, full recomputation, ZeRO-1 over dp x cp, a head tied to the embedding across the
  first and last stage, bf16 (losses rtol 1e-3, parameters within 20% of the update); a tiny
  HF Llama (rotary, GQA) under 1F1B and a Qwen2 under ZB-V; a checkpoint written at cp 2
  resumes bit-exact and loads into cp 1 (one process, here);
* cp 2 x tp 2 x pp 2 with sequence parallelism (8 ranks, one launch): 1F1B.

The references are the independent single-process models of exec_helpers (the built-in GPT on
the whole batch) and test_hf_models (the unsplit AutoModelForCausalLM). Bounds as
test_tensor_parallel: losses rtol 1e-5, parameters rtol 1e-5 / atol 1e-6; parameters are
bitwise equal on every cp rank.
"""
from __future__ import annotations

import functools

import pytest
import torch

from pipeexec import launch
from pipeexec.config import ConfigError
from pipeexec.parallel import context
from pipeexec.parallel.context import ContextParallel
from pipeexec.parallel.sharding import shard_spec
from pipeexec.topology import destroy_topology, init_topology
from pipeexec.training.train import train
from pipeexec.run.assemble import assemble

from exec_helpers import TINY, layout_config
from test_tensor_parallel import check, reference


# -- single process -------------------------------------------------------------------------
def test_load_balanced_chunks_and_their_inverse():
    s, cp = 16, 2
    assert context.positions(s, cp, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert context.positions(s, cp, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    for cp in (1, 2, 4):
        every = torch.cat([context.positions(s, cp, r) for r in range(cp)])
        assert sorted(every.tolist()) == list(range(s))
        # causal work (keys each query sees) is the same on every rank
        assert len({int((context.positions(s, cp, r) + 1).sum()) for r in range(cp)}) == 1
        x = torch.arange(3 * s * 2).reshape(3, s, 2)
        parts = [context.split_sequence(x, cp, r) for r in range(cp)]
        for r, part in enumerate(parts):
            assert torch.equal(part, x[:, context.positions(s, cp, r)])
        assert torch.equal(context.merge_sequence(parts), x)
    with pytest.raises(ValueError, match="sequence length 6 is not a multiple of 2 \\* cp = 4"):
        context.chunk_bounds(6, 2, 0)


def test_the_causal_mask_is_at_the_global_positions():
    for rank in range(2):
        cp = ContextParallel(None, 2, rank)
        mask = context.causal_mask(4, cp, "cpu")
        full = torch.ones(8, 8, dtype=torch.bool).tril()
        assert torch.equal(mask, full[context.positions(8, 2, rank)])
        window = context.causal_mask(4, cp, "cpu", window=3)
        q = context.positions(8, 2, rank).unsqueeze(1)
        assert torch.equal(window, full[q.squeeze(1)] & (q - torch.arange(8) < 3))


def test_uneven_sequences_are_refused_before_any_process():
    with pytest.raises(ConfigError, match=r"parallelism.cp = 2 \(--cp\): model.seq_length = 6 "
                                          r"\(--seq-len\) is not a multiple of 2 \* cp = 4"):
        TINY.with_flat(cp=2, seq_len=6).validate()
    with pytest.raises(ConfigError, match=r"seq_length = 12 \(--seq-len\) is not a multiple of "
                                          r"2 \* cp \* tp = 8"):
        TINY.with_flat(cp=2, tp=2, sequence_parallel=True, seq_len=12).validate()
    TINY.with_flat(cp=2, tp=2, seq_len=12).validate()      # without sp: 12 = 4 x 3
    assert TINY.with_flat(cp=2, tp=2, pp=2, dp=2).world_size == 16


# -- cp 2 x pp 2 ----------------------------------------------------------------------------
def cp_worker(board, tp: int, cp: int, pp: int, cases: list[tuple[str, dict]],
              checkpoint_dir: str | None = None) -> dict:
    topo = init_topology(pp, 1, tp=tp, cp=cp, device="cpu", timeout=120)
    out = {}
    try:
        for schedule, changes in cases:
            cfg = layout_config(schedule, pp, 1, tp=tp, cp=cp, **changes)
            trainer = assemble(cfg, topo, board=board)
            res = train(trainer)
            out[(schedule, tuple(sorted(changes.items())))] = {
                "losses": res.losses, "config": cfg, "grad_norms": res.grad_norms,
                "params": {n: p.detach().clone() for n, p in trainer.named_parameters().items()},
                "specs": {n: shard_spec(p) for st in trainer.stages.values()
                          for n, p in st.named_parameters()},
                "tp_rank": topo.tp_rank, "cp_rank": topo.cp_rank, "dp_rank": topo.dp_rank,
                "pp_rank": topo.pp_rank}
        if checkpoint_dir is not None:
            out["checkpoint"] = _resume(topo, board, cp, pp, checkpoint_dir)
    finally:
        destroy_topology(topo)
    return out


CKPT_STEPS = 4


def _resume(topo, board, cp: int, pp: int, root: str) -> dict:
    """4 steps straight; 2 steps, a save, a fresh trainer loading it, 2 more steps."""
    from pipeexec.checkpoint.load import load_checkpoint
    from pipeexec.checkpoint.save import save_checkpoint

    cfg = layout_config("1f1b", pp, 1, cp=cp, steps=CKPT_STEPS)
    straight = assemble(cfg, topo, board=board)
    whole = train(straight).losses
    first = assemble(cfg, topo, board=board)
    while first.iteration < 2:
        first.step()
    save_checkpoint(first, root, timeout=60)
    saved = {n: p.detach().clone() for n, p in first.named_parameters().items()}
    second = assemble(cfg, topo, board=board)
    load_checkpoint(second, root)
    resumed = train(second).losses
    return {"whole": whole, "resumed": resumed, "saved": saved, "cp_rank": topo.cp_rank,
            "final": {n: p.detach().clone() for n, p in second.named_parameters().items()},
            "straight": {n: p.detach().clone() for n, p in straight.named_parameters().items()}}


GPT_CASES = (("1f1b", {}), ("zbv", {}), ("zbv", {"nccl_matching": True}),
             ("interleaved", {}), ("dualpipev", {}), ("1f1b", {"recompute": "full"}),
             ("zbv", {"zero": 1}), ("1f1b", {"tie_embeddings": True}),
             ("zbv", {"precision": "bf16"}))
HF_CASES = (("llama", "1f1b"), ("qwen2", "zbv"))
# the HF runs' AdamW epsilon, as test_hf_tensor_parallel's (elements whose gradient nearly
# cancels amplify rounding less)
HF_ADAM_EPS = 1e-5


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, str]:
    pytest.importorskip("transformers")
    from test_hf_models import FAMILIES, write_model
    root = tmp_path_factory.mktemp("hf-cp")
    return {name: str(write_model(root / name, FAMILIES[name])) for name, _ in HF_CASES}


def hf_case(hf_dirs, name: str, schedule: str) -> tuple[str, tuple]:
    d = hf_dirs[name]
    changes = {"plan": TINY.with_hf_model(d).plan, "hf_model": d, "eps": HF_ADAM_EPS}
    return schedule, tuple(sorted(changes.items()))


@pytest.fixture(scope="module")
def cp2_pp2(request, tmp_path_factory) -> tuple[list[dict], str]:
    """Every cp 2 x pp 2 case in one launch (the HF ones when transformers is installed)."""
    cases = [(s, tuple(sorted(ch.items()))) for s, ch in GPT_CASES]
    try:
        dirs = request.getfixturevalue("hf_dirs")
        cases += [hf_case(dirs, n, s) for n, s in HF_CASES]
    except pytest.skip.Exception:
        pass
    root = str(tmp_path_factory.mktemp("cp-ckpt"))
    results = launch(cp_worker, 4, (1, 2, 2, [(s, dict(ch)) for s, ch in cases], root),
                     timeout=900)
    return results, root


def check_cp_replicas(results: list[dict], key) -> list[dict]:
    """Parameters are bitwise equal on every cp rank; returns cp rank 0's results."""
    by_place = {}
    for r in results:
        e = r[key]
        by_place.setdefault((e["pp_rank"], e["tp_rank"]), {})[e["cp_rank"]] = e["params"]
    for place, ranks in by_place.items():
        for n, p in ranks[0].items():
            for c, other in ranks.items():
                assert torch.equal(other[n], p), f"{key[0]} {n} differs on cp rank {c} at {place}"
    return [r for r in results if r[key]["cp_rank"] == 0]


@pytest.mark.slow
@pytest.mark.parametrize("case", GPT_CASES,
                         ids=[f"{s}-{'-'.join(ch) or 'plain'}" for s, ch in GPT_CASES])
def test_cp2_pp2_equals_one_process(cp2_pp2, case):
    results, _ = cp2_pp2
    key = (case[0], tuple(sorted(case[1].items())))
    losses = [r[key]["losses"] for r in results]
    assert all(ls == losses[0] for ls in losses), "ranks disagree on the losses"
    check(check_cp_replicas(results, key), key, 1)


@pytest.mark.slow
@pytest.mark.parametrize("name,schedule", HF_CASES, ids=[f"{n}-{s}" for n, s in HF_CASES])
def test_hf_cp2_pp2_equals_the_unsplit_model(cp2_pp2, hf_dirs, name, schedule):
    from pipeexec.models.hf import hf_dir_stack, hf_name
    from pipeexec.models.hf_config import read_hf_config
    from test_hf_models import hf_reference_train, reference_config

    results, _ = cp2_pp2
    key = hf_case(hf_dirs, name, schedule)
    cfg = results[0][key]["config"]
    info = read_hf_config(cfg.inputs.hf_model)
    ref_losses, ref_params = hf_reference_train(reference_config(cfg).with_flat(cp=1))
    losses = [r[key]["losses"] for r in results]
    assert all(ls == losses[0] for ls in losses), "ranks disagree on the losses"
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(ref_losses), rtol=1e-5,
                               atol=0)
    spec = hf_dir_stack(cfg.inputs.hf_model)
    seen = set()
    for r in check_cp_replicas(results, key):
        for n, p in r[key]["params"].items():
            hf = hf_name(info.model_type, info.layers, spec.canonical(n))
            seen.add(hf)
            torch.testing.assert_close(p, ref_params[hf], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=n: f"{name} {schedule}: {n}: {m}")
    assert seen == set(ref_params)


@pytest.mark.slow
def test_a_cp2_checkpoint_resumes_bit_exact_and_loads_into_cp1(cp2_pp2):
    from pipeexec.checkpoint.load import load_checkpoint
    from pipeexec.parallel.mesh import Mesh
    from pipeexec.topology import Topology

    results, root = cp2_pp2
    ckpts = [r["checkpoint"] for r in results]
    for c in ckpts:
        assert c["resumed"] == c["whole"][2:]              # bit-exact
        for n, p in c["final"].items():
            assert torch.equal(p, c["straight"][n]), n
    saved = {n: p for c in ckpts if c["cp_rank"] == 0 for n, p in c["saved"].items()}
    # cp 1, pp 1 in this process: exactly the saved weights, and the same next steps
    cfg = layout_config("1f1b", 2, 1, steps=CKPT_STEPS).with_flat(pp=1, vpp=1)
    alone = Topology.of(Mesh(), 0, device=torch.device("cpu"), backend="gloo")
    trainer = assemble(cfg, alone)
    load_checkpoint(trainer, root)
    assert trainer.iteration == 2
    for n, p in trainer.named_parameters().items():
        assert torch.equal(p, saved[n]), n
    losses = train(trainer).losses
    whole = ckpts[0]["whole"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(whole[2:]), rtol=1e-5, atol=0)
    final = {n: p for c in ckpts if c["cp_rank"] == 0 for n, p in c["straight"].items()}
    for n, p in trainer.named_parameters().items():
        torch.testing.assert_close(p, final[n], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=n: f"{n}: {m}")


# -- cp 2 x tp 2 x pp 2, sequence parallel ---------------------------------------------------
@functools.lru_cache(maxsize=None)
def _cp_tp_run() -> list[dict]:
    cases = [("1f1b", {"sequence_parallel": True})]
    return launch(cp_worker, 8, (2, 2, 2, cases), timeout=900)


@pytest.mark.slow
def test_cp2_tp2_pp2_sequence_parallel_equals_one_process():
    from test_tensor_parallel import whole_model
    results = _cp_tp_run()
    key = ("1f1b", (("sequence_parallel", True),))
    assert results[0][key]["config"].world_size == 8
    losses = [r[key]["losses"] for r in results]
    assert all(ls == losses[0] for ls in losses), "ranks disagree on the losses"
    ref_losses, ref_params, _ = reference()
    params = whole_model(check_cp_replicas(results, key), key, 2)
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(ref_losses), rtol=1e-5,
                               atol=0)
    assert params.keys() == ref_params.keys()
    for n in ref_params:
        torch.testing.assert_close(params[n], ref_params[n], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=n: f"{n}: {m}")
