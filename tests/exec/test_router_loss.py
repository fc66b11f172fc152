"""The routers' load-balancing loss (``output_router_logits = true``) through the pipeline equals
Hugging Face's own: Mixtral (4 experts, top-2), Qwen2-MoE (4 experts, top-2, a shared expert
with its sigmoid gate, ``norm_topk_prob``) and Qwen3-MoE (per-head q/k norms, head_dim 16),
4 decoder layers, ``router_aux_loss_coef`` 0.5 (large, so that the aux term moves the
parameters well beyond the bounds).

* Unit (one process): the statistics each stage adds, carried in the packed activation across
  a stage boundary (detached and re-leafed, as the runtime hands it over), give Hugging Face's
  ``load_balancing_loss_func`` on the same router logits bit for bit, and the router weights'
  gradients of ``coef * aux`` through both stages are those of Hugging Face's function; bf16
  and fp16 activations carry the fp32 statistics and their gradients bit for bit.
* Pipelined (forked gloo ranks): losses and parameters after 3 steps equal the unsplit
  ``*ForCausalLM`` trained on the same microbatches with its own ``loss`` (``labels`` given as
  ``shift_labels``: our targets are already the next tokens; the aux term included), AdamW and
  clip_grad_norm_: rtol 1e-5 (parameters atol 1e-6), as tests/exec/test_hf_models.py. pp 2
  under 1F1B and ZB-V, aux on and off, ZB-V with full recomputation, Qwen2-MoE and Qwen3-MoE
  under 1F1B (fast suite); every schedule at pp 2 with selective recomputation once, pp 2 x
  dp 2 (and ZB-V under ZeRO-3), tp 2 x pp 2 with sequence parallelism (Mixtral, Qwen2-MoE, Qwen3-MoE; Qwen2-MoE
  without sp too), cp 2 x pp 2 (all three) and cp 2 x tp 2 x pp 2 with sp (slow); bf16 and
  fp16 ZB-V within 1e-2 of the fp32 reference (slow); expert parallelism: ep 2 x dp 2 (fast), ep 2 x pp 2 x dp 2 (ZB-V;
  Qwen2-MoE under 1F1B; slow).
"""
from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

import pipesim  # noqa: E402
from pipeexec import launch  # noqa: E402
from pipeexec.config import TrainConfig  # noqa: E402
from pipeexec.models.hf import hf_dir_stack, hf_name  # noqa: E402
from pipeexec.models.hf_config import read_hf_config  # noqa: E402
from pipeexec.models.hf_router_loss import RouterLoss  # noqa: E402

from exec_helpers import TINY, choose_microbatches, layouts_worker  # noqa: E402
from test_hf_models import (ADAM_EPS, hf_reference_train, reference_config,  # noqa: E402
                            write_model)

COEF = 0.5
_BASE = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=32, max_position_embeddings=64, bos_token_id=1,
             eos_token_id=2, num_experts_per_tok=2, router_aux_loss_coef=COEF,
             output_router_logits=True)
MODELS = {
    "mixtral": dict(model_type="mixtral", num_local_experts=4, **_BASE),
    "qwen2_moe": dict(model_type="qwen2_moe", num_experts=4, moe_intermediate_size=24,
                      shared_expert_intermediate_size=40, norm_topk_prob=True, **_BASE),
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=4, moe_intermediate_size=24,
                      head_dim=16, norm_topk_prob=True, **_BASE),
    "mixtral-off": dict(model_type="mixtral", num_local_experts=4,
                        **dict(_BASE, output_router_logits=False)),
}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("router-loss")
    return {name: str(write_model(root / name, cfg)) for name, cfg in MODELS.items()}


def _modeling(model_type: str):
    import importlib
    return importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")


# -- one process -------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_statistics_through_two_stages_equal_hf_load_balancing_loss(model_dirs, family):
    spec = hf_dir_stack(model_dirs[family])
    layers = [spec.build_layer(i, seed=3) for i in range(spec.num_layers)]
    logits = []
    gates = [layer.router_module() for layer in layers[1:-1]]
    assert all(g is not None for g in gates)
    for g in gates:
        g.register_forward_hook(lambda m, a, out: logits.append(out[0]))
    tokens = torch.randint(0, 32, (3, 8), generator=torch.Generator().manual_seed(0))
    first, second = layers[:3], layers[3:]          # the boundary after decoder layer 2
    h = tokens
    for layer in first:
        h = layer(h)
    assert h.shape == (3, 8 + 1, 32)                # the statistics' row (9 fp32 values)
    handed = h.detach().requires_grad_(True)        # what the runtime sends and re-leafs
    out = handed
    for layer in second:
        out = layer(out)
    term = out[-1]                                   # the head's coef * aux
    # Hugging Face's function on the router logits of the same forward, not cut in two
    logits.clear()
    h_whole = tokens
    for layer in layers[:-1]:
        h_whole = layer(h_whole)
    cfg = layers[1].config
    want = _modeling(cfg.model_type).load_balancing_loss_func(tuple(logits), 4, 2)
    assert torch.equal(term, COEF * want), (term.item(), COEF * want.item())
    # gradients: the later stage's backward hands dL/d(packed) to the earlier one
    weights = [g.weight for g in gates]
    ours = torch.autograd.grad(term, weights[2:] + [handed])
    ours = list(torch.autograd.grad(h, weights[:2], ours[-1])) + list(ours[:-1])
    hf = torch.autograd.grad(COEF * want, weights)
    for j, (a, b) in enumerate(zip(ours, hf)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9, msg=lambda m, j=j: f"gate {j}: {m}")
    assert all(b.abs().max() > 0 for b in hf)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_activations_carry_fp32_statistics_bit_for_bit(dtype):
    """The statistics ride as fp32 bits in a 16-bit activation: values whose low halves are
    16-bit NaN or negative-zero patterns come back unchanged, and so do their gradients."""
    router = RouterLoss(experts=3, top_k=1, coef=1.0)
    odd = torch.tensor([0x3F807FC1, 0x40008000, 0x7F7FFFFF, 0x00000001, 0x3F800000, 0x41200001,
                        0x42C80000], dtype=torch.int32).view(torch.float32)
    side = odd.clone().requires_grad_(True)
    hidden = torch.randn(2, 5, 4).to(dtype).requires_grad_(True)
    packed = router.pack(hidden, side)
    assert packed.dtype == dtype and packed.shape == (2, 5 + router.extra_rows(4, dtype), 4)
    carried = packed.detach().requires_grad_(True)
    h, s = router.unpack(carried)
    assert torch.equal(h, hidden.detach())
    assert torch.equal(s.view(torch.int32), odd.view(torch.int32))
    g_side = odd.flip(0).clone()
    g_hidden = torch.randn(2, 5, 4).to(dtype)
    (g_packed,) = torch.autograd.grad((h, s), carried, (g_hidden, g_side))
    got_hidden, got_side = torch.autograd.grad(packed, (hidden, side), g_packed)
    assert torch.equal(got_hidden, g_hidden)
    assert torch.equal(got_side.view(torch.int32), g_side.view(torch.int32))


def test_a_dense_tensor_is_refused_where_a_packed_one_is_expected():
    router = RouterLoss(experts=4, top_k=2, coef=0.1)
    with pytest.raises(ValueError, match="not the packed activation"):
        router.unpack(torch.zeros(6, 32))
    with pytest.raises(ValueError, match="cannot carry the statistics"):
        router.start(torch.zeros(1, 2, 32, dtype=torch.float64))


# -- pipelined against the unsplit model ---------------------------------------------------
@functools.lru_cache(maxsize=None)
def reference_for(cfg: TrainConfig):
    return hf_reference_train(cfg, own_loss=True)


def base(directory: str, **changes) -> dict:
    return {"plan": TINY.with_hf_model(directory).plan, "hf_model": directory, "eps": ADAM_EPS,
            **changes}


def check(entries: list[dict], key, *, whole: dict | None = None) -> None:
    """Every rank's parameters (or ``whole``: put back together over tp) and the last stage's
    losses against the reference."""
    cfg = entries[0][key]["config"]
    info = read_hf_config(cfg.inputs.hf_model)
    what = f"{info.model_type} {key}"
    ref_losses, ref_params = reference_for(reference_config(cfg).with_flat(
        tp=1, cp=1, ep=1, sequence_parallel=False, recompute="none"))
    losses = [e[key]["losses"] for e in entries]
    assert all(ls == losses[0] for ls in losses), f"{what}: ranks disagree on the losses"
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(ref_losses), rtol=1e-5,
                               atol=0, msg=lambda m: f"{what}: losses: {m}")
    spec = hf_dir_stack(cfg.inputs.hf_model)
    params = whole if whole is not None else {n: p for e in entries
                                              for n, p in e[key]["params"].items()}
    seen = set()
    for n, p in params.items():
        hf = hf_name(info.model_type, info.layers, spec.canonical(n))
        seen.add(hf)
        torch.testing.assert_close(p, ref_params[hf], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=n, hf=hf: f"{what}: {n} ({hf}): {m}")
    assert seen == set(ref_params), what


def _key(schedule: str, changes: dict):
    return (schedule, tuple(sorted(changes.items())))


def test_pp2_1f1b_and_zbv_equal_hf_with_the_router_loss(model_dirs):
    mixtral, off, qwen = (model_dirs[k] for k in ("mixtral", "mixtral-off", "qwen2_moe"))
    cases = [("1f1b", base(mixtral)), ("zbv", base(mixtral)),
             ("zbv", base(mixtral, recompute="full")), ("zbv", base(off)),
             ("1f1b", base(qwen)), ("1f1b", base(model_dirs["qwen3_moe"]))]
    results = launch(layouts_worker, 2, (2, 1, cases), timeout=600)
    last = [r for r in results if r[_key(*cases[0])]["pp_rank"] == 1]
    for schedule, changes in cases:
        key = _key(schedule, changes)
        check(results, key)
        losses = last[0][key]["losses"]
        assert losses == next(r[key]["losses"] for r in last)
    # the aux term is there: the same model without it trains to other losses
    on = reference_for(reference_config(last[0][_key(*cases[1])]["config"]))[0]
    plain = reference_for(reference_config(last[0][_key(*cases[3])]["config"]))[0]
    assert abs(on[0] - plain[0]) > 0.5 * COEF       # aux >= 1 (its minimum: balanced)


@pytest.mark.slow
def test_every_schedule_at_pp2_equals_hf_with_the_router_loss(model_dirs):
    mixtral = model_dirs["mixtral"]
    cases = [(name, base(mixtral)) for name in pipesim.schedule_names()
             if name not in ("1f1b", "zbv") and choose_microbatches(name, 2, 1)]
    cases.append(("interleaved", base(mixtral, recompute="selective")))
    assert {"dualpipev", "interleaved"} <= {n for n, _ in cases}
    results = launch(layouts_worker, 2, (2, 1, cases), timeout=900)
    for schedule, changes in cases:
        check(results, _key(schedule, changes))


@pytest.mark.slow
def test_pp2_dp2_equals_hf_with_the_router_loss(model_dirs):
    """pp 2 x dp 2, also ZB-V under ZeRO-3 (parameters gathered around each action)."""
    from test_hf_tensor_parallel import ADAM_EPS as TP_EPS   # dp's summation order, as tp's

    cases = [("1f1b", base(model_dirs["mixtral"], eps=TP_EPS)),
             ("zbv", base(model_dirs["mixtral"], eps=TP_EPS, zero=3))]
    results = launch(layouts_worker, 4, (2, 2, cases), timeout=600)
    for case in cases:
        check(results, _key(*case))


@pytest.mark.slow
def test_tp2_pp2_sp_equals_hf_with_the_router_loss(model_dirs):
    from test_tensor_parallel import tp_worker, whole_model

    from test_hf_tensor_parallel import ADAM_EPS as TP_EPS   # tp's summation order: its reason

    sp = {"sequence_parallel": True, "eps": TP_EPS}
    cases = [("1f1b", base(model_dirs["mixtral"], **sp)),
             ("zbv", base(model_dirs["qwen2_moe"], **sp)),
             ("1f1b", base(model_dirs["qwen2_moe"], eps=TP_EPS)),
             ("zbv", base(model_dirs["qwen3_moe"], **sp))]
    results = launch(tp_worker, 4, (2, 2, 1, cases), timeout=900)
    for case in cases:
        key = _key(*case)
        check(results, key, whole=whole_model(results, key, 2))


@pytest.mark.slow
def test_cp2_equals_hf_with_the_router_loss(model_dirs):
    """cp 2 x pp 2, and cp 2 x tp 2 x pp 2 with sp: each cp rank's routers see its tokens, the
    head sums the statistics over cp; gradients averaged over cp hold the aux's once."""
    from test_context_parallel import cp_worker
    from test_tensor_parallel import whole_model

    from test_hf_tensor_parallel import ADAM_EPS as TP_EPS   # another summation order, as tp's

    cases = [("1f1b", base(model_dirs["mixtral"], eps=TP_EPS)),
             ("zbv", base(model_dirs["qwen2_moe"], eps=TP_EPS)),
             ("1f1b", base(model_dirs["qwen3_moe"], eps=TP_EPS))]
    results = launch(cp_worker, 4, (1, 2, 2, cases), timeout=900)
    for case in cases:
        check([r for r in results if r[_key(*case)]["cp_rank"] == 0], _key(*case))
        check([r for r in results if r[_key(*case)]["cp_rank"] == 1], _key(*case))
    sp_case = [("1f1b", base(model_dirs["mixtral"], sequence_parallel=True, eps=TP_EPS))]
    results = launch(cp_worker, 8, (2, 2, 2, sp_case), timeout=900)
    key = _key(*sp_case[0])
    ranks = [r for r in results if r[key]["cp_rank"] == 0]
    check(ranks, key, whole=whole_model(ranks, key, 2))


def test_ep2_dp2_equals_hf_with_the_router_loss(model_dirs):
    """Expert parallelism (`pipeexec.parallel.experts`): the router stays replicated on each
    replica's tokens, so each replica's statistics are its own microbatch's, as Hugging Face's."""
    from test_expert_parallel import ep_worker, whole_model as ep_whole_model

    results = launch(ep_worker, 2, (1, 1, 2, 2, [("1f1b", {"hf_model": model_dirs["mixtral"]})]),
                     timeout=600)
    key = ("1f1b", ())
    check(results, key, whole=ep_whole_model(results, key, 1, 2))


@pytest.mark.slow
def test_ep2_pp2_dp2_equals_hf_with_the_router_loss(model_dirs):
    from test_expert_parallel import ep_worker, whole_model as ep_whole_model

    cases = [("zbv", {"hf_model": model_dirs["mixtral"]}),
             ("1f1b", {"hf_model": model_dirs["qwen2_moe"], "microbatches": 2})]
    results = launch(ep_worker, 4, (1, 2, 2, 2, cases), timeout=900)
    for schedule, changes in cases:
        key = (schedule, tuple(sorted((k, v) for k, v in changes.items() if k != "hf_model")))
        check(results, key, whole=ep_whole_model(results, key, 1, 2))


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_16bit_runs_carry_the_router_loss(model_dirs, precision):
    """bf16 / fp16 activations (fp32 masters) carry the statistics as fp32 bits through ZB-V's
    boundaries: the losses stay within 1e-2 of the fp32 reference with the aux term, ten times
    closer than to the one without it."""
    cases = [("zbv", base(model_dirs["mixtral"], precision=precision))]
    results = launch(layouts_worker, 2, (2, 1, cases), timeout=600)
    key = _key(*cases[0])
    cfg = results[0][key]["config"]
    losses = next(r[key]["losses"] for r in results if r[key]["pp_rank"] == 1)
    on = reference_for(reference_config(cfg))[0]
    off = reference_for(reference_config(cfg).with_flat(hf_model=model_dirs["mixtral-off"]))[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(on), rtol=1e-2, atol=0)
    assert max(abs(a - b) for a, b in zip(losses, on)) * 10 < min(
        abs(a - b) for a, b in zip(losses, off))


@pytest.mark.slow
def test_cp2_ep2_pp2_equals_hf_with_the_router_loss(model_dirs):
    """The ep group is the cp group: each rank's routers see its sequence chunks (the head
    sums the statistics over cp), its tokens dispatched to the experts' owners."""
    from test_expert_parallel import ep_worker, whole_model as ep_whole_model

    cases = [("1f1b", {"hf_model": model_dirs["mixtral"]})]     # (ep_config: AdamW eps 1e-5)
    results = launch(ep_worker, 4, (1, 2, 1, 2, cases, 2), timeout=900)   # tp pp dp ep, cp 2
    key = ("1f1b", ())
    check(results, key, whole=ep_whole_model(results, key, 1, 2))
