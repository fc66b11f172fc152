"""ModelSpec: presets against their published parameter counts, vocab padding, from_hf_config."""
import json

import pytest

import pipesim
from pipesim.plan.model import PRESETS, ModelSpec, get_model

# Parameter counts published by the model cards / Hugging Face model repositories
# (safetensors metadata "total"), and the papers' totals / active parameters.
PUBLISHED = {
    "llama2-7b": 6_738_415_616,       # meta-llama/Llama-2-7b-hf
    "llama2-70b": 68_976_648_192,     # meta-llama/Llama-2-70b-hf
    "llama3-8b": 8_030_261_248,       # meta-llama/Meta-Llama-3-8B
    "llama3-70b": 70_553_706_496,     # meta-llama/Meta-Llama-3-70B
    "llama3-405b": 405_853_388_800,   # meta-llama/Llama-3.1-405B
    "mixtral-8x7b": 46_702_792_704,   # mistralai/Mixtral-8x7B-v0.1
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_counts_match_the_published_ones(name):
    assert PRESETS[name].num_params() == PUBLISHED[name]


def test_moe_active_parameters_match_the_papers():
    # Mixtral paper §2.1: 13B active parameters of 47B; Qwen1.5-MoE-A2.7B: 14.3B, 2.7B active;
    # Qwen3-30B-A3B: 30.5B total, 3.3B activated (Qwen3 technical report, Table 2).
    assert PRESETS["mixtral-8x7b"].active_params() / 1e9 == pytest.approx(12.9, abs=0.05)
    q = PRESETS["qwen1.5-moe-a2.7b"]
    assert q.num_params() / 1e9 == pytest.approx(14.3, abs=0.05)
    assert q.active_params() / 1e9 == pytest.approx(2.7, abs=0.05)
    q3 = PRESETS["qwen3-30b-a3b"]
    assert q3.num_params() / 1e9 == pytest.approx(30.5, abs=0.05)
    assert q3.active_params() / 1e9 == pytest.approx(3.35, abs=0.05)


def test_gpt3_shapes_kept_and_175b_size():
    m = get_model("GPT3-175B")
    assert (m.layers, m.hidden, m.heads, m.seq_length, m.vocab) == (96, 12288, 96, 2048, 50257)
    assert m.num_params() / 1e9 == pytest.approx(174.6, abs=0.1)   # "175B"
    assert (m.num_kv_heads, m.kv_channels, m.ffn, m.mlp) == (96, 128, 4 * 12288, "gelu")


def test_vocab_padding_as_megatron():
    # megatron/training/tokenizer/tokenizer.py _vocab_size_with_padding: multiple of
    # make_vocab_size_divisible_by (128) * tp
    m = get_model("gpt3-1.3b")
    assert m.padded_vocab(1) == 50304
    assert m.padded_vocab(8) == 51200
    assert get_model("llama3-8b").padded_vocab(8) == 129024
    assert get_model("llama3-8b").padded_vocab(1) == 128256


def test_gqa_layer_params_by_hand():
    m = PRESETS["llama3-70b"]           # q 8192, kv 8 x 128 = 1024, SwiGLU 28672, RMSNorm
    assert m.layer_params()["dense"] == 8192 * (8192 + 2 * 1024) + 8192 * 8192 \
        + 3 * 8192 * 28672 + 2 * 8192


def test_bad_model_fields_name_the_field():
    with pytest.raises(pipesim.PlanError, match="model.kv_heads"):
        ModelSpec("x", 2, 64, 6, 32, 100, kv_heads=4)
    with pytest.raises(pipesim.PlanError, match="model.mlp"):
        ModelSpec("x", 2, 64, 4, 32, 100, mlp="relu2")
    with pytest.raises(pipesim.PlanError, match="model.top_k"):
        ModelSpec("x", 2, 64, 4, 32, 100, experts=4, top_k=5)
    with pytest.raises(pipesim.PlanError, match="unknown model preset"):
        get_model("llama9-1t")


def _write(tmp_path, cfg):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def test_from_hf_config_llama(tmp_path):
    # the keys of meta-llama/Meta-Llama-3-70B/config.json (hand-written)
    path = _write(tmp_path, {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": 8192, "intermediate_size": 28672, "max_position_embeddings": 8192,
        "num_attention_heads": 64, "num_hidden_layers": 80, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "vocab_size": 128256})
    m = ModelSpec.from_hf_config(path, name="llama3-70b")
    assert m == PRESETS["llama3-70b"]
    assert get_model(str(path)).num_params() == PUBLISHED["llama3-70b"]


def test_from_hf_config_mixtral(tmp_path):
    path = _write(tmp_path, {
        "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
        "vocab_size": 32000, "hidden_act": "silu"})
    m = ModelSpec.from_hf_config(path, seq_length=4096)
    assert (m.experts, m.top_k, m.moe_ffn, m.seq_length) == (8, 2, 14336, 4096)
    assert m.num_params() == PUBLISHED["mixtral-8x7b"]


def test_from_hf_config_qwen_moe_and_head_dim(tmp_path):
    path = _write(tmp_path, {
        "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
        "head_dim": 128, "num_attention_heads": 32, "num_key_value_heads": 4,
        "num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8,
        "moe_intermediate_size": 768, "vocab_size": 151936, "max_position_embeddings": 40960,
        "tie_word_embeddings": False})
    m = ModelSpec.from_hf_config(path, seq_length=4096)
    assert (m.q_size, m.kv_size) == (4096, 512)
    assert m.num_params() == PRESETS["qwen3-30b-a3b"].num_params()


def test_from_hf_config_gpt2(tmp_path):
    # openai-community/gpt2 config.json: 124M parameters (tied embeddings, learned positions)
    path = _write(tmp_path, {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12,
                             "n_positions": 1024, "n_ctx": 1024, "vocab_size": 50257,
                             "activation_function": "gelu_new"})
    m = ModelSpec.from_hf_config(path)
    assert (m.layers, m.hidden, m.heads, m.seq_length, m.tied_embeddings) == (12, 768, 12, 1024, True)
    # GPT-2 small has 124,439,808 parameters with the unpadded 50257-token vocabulary
    assert m.num_params() - (m.padded_vocab() - m.vocab) * m.hidden == 124_439_808
    # GPT2Config's resid/embd/attn_pdrop default to 0.1: dropout; all three 0: none
    assert m.dropout
    no_dropout = _write(tmp_path, {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
                                   "vocab_size": 64, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                                   "attn_pdrop": 0.0})
    assert not ModelSpec.from_hf_config(no_dropout).dropout


def test_from_hf_config_errors(tmp_path):
    with pytest.raises(pipesim.PlanError, match="no such config"):
        ModelSpec.from_hf_config(tmp_path / "missing.json")
    with pytest.raises(pipesim.PlanError, match="has no 'num_hidden_layers'"):
        ModelSpec.from_hf_config(_write(tmp_path, {"model_type": "llama", "hidden_size": 64,
                                                   "num_attention_heads": 4,
                                                   "intermediate_size": 128, "vocab_size": 10}))
    with pytest.raises(pipesim.PlanError, match="not supported"):
        ModelSpec.from_hf_config(_write(tmp_path, {"model_type": "t5"}))


@pytest.mark.parametrize("config, published", [
    # Qwen/Qwen2-7B config.json (hidden 3584, FFN 18944, 28 layers, 28 heads, 4 kv heads,
    # vocab 152064, untied): 7,615,616,512 parameters, the model card's "7.62B"
    (dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
          num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
          tie_word_embeddings=False), 7_615_616_512),
    # Qwen/Qwen2-0.5B config.json (hidden 896, FFN 4864, 24 layers, 14 heads, 2 kv heads,
    # vocab 151936, tied): 494,032,768 parameters, the model card's "494M"
    (dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
          num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True), 494_032_768),
])
def test_qwen2_counts_its_qkv_biases(config, published):
    m = ModelSpec.from_hf_config({"model_type": "qwen2", "hidden_act": "silu",
                                  "max_position_embeddings": 32768, **config}, seq_length=4096)
    assert (m.bias, m.qkv_bias) == (False, True)
    assert m.num_params() == published
    without = m.with_(qkv_bias=None)                     # the biases are what makes it exact
    assert published - without.num_params() == m.layers * (m.q_size + 2 * m.kv_size)
