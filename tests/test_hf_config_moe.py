"""Qwen2-MoE configs read by pipesim (`ModelSpec.from_hf_config`) and mapped by pipeexec
(`pipeexec.models.hf_config`): parameter counts against the Hugging Face model's own (built
on the meta device), the spec written back into a config, and what the spec cannot say
refused before anything runs."""
from __future__ import annotations

import pytest

from pipesim.plan.model import ModelSpec
from pipeexec.models.hf_config import HFModelError, config_for, info_from_config, spec_differences

QWEN2_MOE = dict(model_type="qwen2_moe", hidden_size=32, intermediate_size=48,
                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=40, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                 shared_expert_intermediate_size=40, max_position_embeddings=64)


def _hf_counts(cfg: dict) -> tuple[int, list[int]]:
    """All parameters of Qwen2MoeForCausalLM, and each decoder layer's."""
    transformers = pytest.importorskip("transformers")
    import torch

    config = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    layers = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    return sum(p.numel() for p in model.parameters()), layers


@pytest.mark.parametrize("changes", [{}, {"qkv_bias": False}, {"decoder_sparse_step": 2},
                                     {"tie_word_embeddings": True}])
def test_parameter_count_is_the_hf_models(changes):
    """The shared expert (with its sigmoid gate: hidden parameters a MoE layer), the router,
    q/k/v biases (or none: ``qkv_bias``) and, with ``decoder_sparse_step`` 2, half the layers
    dense: pipesim's count is Hugging Face's."""
    cfg = dict(QWEN2_MOE, **changes)
    model = ModelSpec.from_hf_config(cfg, seq_length=8).with_(vocab_divisible_by=1)
    total, layers = _hf_counts(cfg)
    assert model.num_params() == total
    qkv = model.bias if model.qkv_bias is None else model.qkv_bias
    assert model.shared_expert_gate and qkv == changes.get("qkv_bias", True)
    if "decoder_sparse_step" not in changes:      # where the MoE layers sit: see the refusal
        assert [sum(model.layer_params(m).values()) for m in model.moe_pattern()] == layers
    # without the gate the count would be short by hidden per MoE layer
    assert model.with_(shared_expert_gate=False).num_params() == \
        total - 32 * sum(model.moe_pattern())


def test_mixtral_has_no_shared_expert_gate():
    spec = ModelSpec.from_hf_config(dict(QWEN2_MOE, model_type="mixtral", num_local_experts=4),
                                    seq_length=8)
    assert not spec.shared_expert_gate


def test_the_spec_spells_the_config_back():
    model = ModelSpec.from_hf_config(QWEN2_MOE, seq_length=8).with_(vocab_divisible_by=1)
    cfg = config_for(model)
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                "shared_expert_intermediate_size", "intermediate_size", "decoder_sparse_step"):
        assert cfg[key] == QWEN2_MOE.get(key, 1), key
    assert cfg["qkv_bias"] is True
    assert spec_differences(model) == []
    wider = model.with_(moe_ffn_hidden=32, shared_expert_ffn_hidden=16, qkv_bias=None)
    back = config_for(wider)       # qkv_bias None: as bias (False), the spec's normal form
    assert (back["moe_intermediate_size"], back["shared_expert_intermediate_size"],
            back["qkv_bias"]) == (32, 16, False)
    assert spec_differences(wider) == []


@pytest.mark.parametrize("changes, match", [
    ({"mlp_only_layers": [0, 2]}, r"mlp_only_layers = \[0, 2\]: the plan's model"),
    ({"decoder_sparse_step": 2}, r"decoder_sparse_step = 2: Hugging Face makes layer j sparse "
                                 r"when \(j \+ 1\) % 2 == 0"),
])
def test_what_the_spec_cannot_say_is_refused(changes, match):
    with pytest.raises(HFModelError, match=match):
        info_from_config(dict(QWEN2_MOE, **changes), "dir")
    info_from_config(dict(QWEN2_MOE, output_router_logits=True), "dir")    # the aux loss runs


def test_mixtral_router_jitter_is_refused():
    mixtral = dict(QWEN2_MOE, model_type="mixtral", num_local_experts=4)
    info_from_config(dict(mixtral, router_jitter_noise=0.0), "dir")
    with pytest.raises(HFModelError, match=r"router_jitter_noise = 0.1: the router's input noise"):
        info_from_config(dict(mixtral, router_jitter_noise=0.1), "dir")


QWEN3_MOE = dict(model_type="qwen3_moe", hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=40,
                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                 max_position_embeddings=64)


def test_qwen3_moe_parameter_count_is_the_hf_models():
    """Qwen3-MoE: no shared expert, no q/k/v biases, per-head q and k norms (``qk_norm``:
    2 head_dim a layer)."""
    model = ModelSpec.from_hf_config(QWEN3_MOE, seq_length=8).with_(vocab_divisible_by=1)
    total, layers = _hf_counts(QWEN3_MOE)
    assert model.qk_norm and not model.shared_expert_gate and not model.shared_expert_ffn_hidden
    assert model.num_params() == total
    assert [sum(model.layer_params(m).values()) for m in model.moe_pattern()] == layers
    assert model.with_(qk_norm=False).num_params() == total - 4 * 2 * 16
    cfg = config_for(model)
    assert (cfg["num_experts"], cfg["moe_intermediate_size"]) == (4, 24)
    assert "num_local_experts" not in cfg and spec_differences(model) == []
    assert spec_differences(model.with_(shared_expert_ffn_hidden=16)) != []
    with pytest.raises(HFModelError, match="attention_bias = true: Qwen3-MoE's q, k, v and o"):
        info_from_config(dict(QWEN3_MOE, attention_bias=True), "dir")
