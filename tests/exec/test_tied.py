"""Tied parameters (`pipeexec.training.tied`): a head tied to the embedding stays one parameter
across ranks, and training equals a single-process model where the head IS the embedding
(one ``nn.Parameter``: plain torch, AdamW, clip_grad_norm_ over the de-duplicated parameters).

Bounds as in test_exec_equivalence: fp32 rtol 1e-5, atol 1e-6 on parameters.
"""
from __future__ import annotations

import pytest
import torch

from pipeexec import launch
from pipeexec.config import GPT_MODEL
from pipeexec.model import gpt_stack
from pipeexec.training.tied import TiedParameters, TiedSet, find_tied

from exec_helpers import GLOBAL_BATCH, TINY, assert_grad_norms, layouts_worker, reference_run

HEAD = f"layers.{TINY.plan.model.layers + 1}.lm_head.weight"


def test_find_tied_names_the_sets_their_holders_and_source():
    # a head tied to the embedding on another rank, a model part held twice (two ranks), and
    # an alias on the same rank as its canonical parameter
    table = {0: [("layers.0.tok", "layers.0.tok"), ("layers.1.w", "layers.1.w"),
                 ("layers.9.head", "layers.0.tok")],
             1: [("layers.1.w", "layers.1.w"), ("layers.2.w", "layers.2.w")],
             2: [("layers.5.head", "layers.0.tok")]}
    assert find_tied(table) == [
        TiedSet("layers.0.tok", ((0, 2), (2, 1)), source=0),
        TiedSet("layers.1.w", ((0, 1), (1, 1)), source=0)]
    # the canonically named instance is the source even when a lower rank holds an alias
    assert find_tied({0: [("a", "e")], 3: [("e", "e")]}) == [TiedSet("e", ((0, 1), (3, 1)), 3)]
    assert find_tied({0: [("x", "x")], 1: [("y", "y")]}) == []


def test_on_one_rank_an_alias_takes_the_value_and_the_summed_gradient():
    emb, head = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(4, 3))
    g_emb, g_head = torch.randn(4, 3), torch.randn(4, 3)
    # the alias comes first in stage order here: the canonically named one is still the source
    inst = [("layers.5.w", "layers.0.tok", head, g_head), ("layers.0.tok", "layers.0.tok", emb, g_emb)]
    tied = TiedParameters(inst, find_tied({0: [(a, b) for a, b, _, _ in inst]}), pp_rank=0)
    before = emb.detach().clone()
    tied.copy_from_source()
    assert torch.equal(head, before) and torch.equal(emb, before)
    total = g_emb + g_head
    tied.reduce()
    assert torch.equal(g_emb, total) and torch.equal(g_head, total)
    assert torch.allclose(tied.duplicate_sq(), (total * total).sum())


def test_a_rank_with_a_missing_instance_is_refused():
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="pp rank 0: tied parameter 'e' has 1 instances here"):
        TiedParameters([("e", "e", p, torch.zeros(2))], [TiedSet("e", ((0, 2),), 0)], pp_rank=0)
    with pytest.raises(ValueError, match="no process group"):
        TiedParameters([("e", "e", p, torch.zeros(2))], [TiedSet("e", ((0, 1), (1, 1)), 0)],
                       pp_rank=0)


def test_the_spec_names_the_head_an_alias_of_the_embedding():
    spec = gpt_stack(GPT_MODEL.with_(layers=2, hidden=8, heads=2, seq_length=4, vocab=16,
                                     tied_embeddings=True))
    assert spec.canonical("layers.3.lm_head.weight") == "layers.0.tok"
    assert spec.canonical("layers.1.qkv.weight") == "layers.1.qkv.weight"
    assert gpt_stack(GPT_MODEL.with_(layers=2, hidden=8, heads=2, seq_length=4, vocab=16)).tied == ()


def _check(results, reference):
    ref_losses, ref_params, ref_norms = reference
    for key in results[0]:
        case = key[0]
        merged = {}
        for r in results:
            merged.update(r[key]["params"])
        losses = results[0][key]["losses"]
        assert losses == pytest.approx(ref_losses, rel=1e-5), case
        for r in results:      # the tied gradient summed over its instances, counted once
            assert_grad_norms(r[key]["grad_norms"], ref_norms, case)
        # both instances equal the one reference parameter
        for name in ("layers.0.tok", HEAD):
            torch.testing.assert_close(merged[name], ref_params["layers.0.tok"], rtol=1e-5,
                                       atol=1e-6, msg=f"{case}: {name}")
        for name, ref in ref_params.items():
            torch.testing.assert_close(merged[name], ref, rtol=1e-5, atol=1e-6,
                                       msg=f"{case}: {name}")


REF = TINY.with_flat(tie_embeddings=True, microbatches=4, micro_batch_size=GLOBAL_BATCH // 4)


def _reference():
    ref = reference_run(REF)
    return ref.losses, ref.params, ref.grad_norms


def test_tied_head_across_two_ranks_equals_one_parameter():
    cases = [("1f1b", {"tie_embeddings": True}), ("zbv", {"tie_embeddings": True})]
    results = launch(layouts_worker, 2, args=(2, 1, cases), timeout=180)
    _check(results, _reference())


@pytest.mark.slow
@pytest.mark.parametrize("pp,dp", [(2, 2), (4, 1)])
def test_tied_head_with_data_parallel_and_deeper_pipelines(pp, dp):
    cases = [(name, {"tie_embeddings": True}) for name in ("interleaved", "zbv", "zb-h1")]
    results = launch(layouts_worker, pp * dp, args=(pp, dp, cases), timeout=300)
    _check(results, _reference())
