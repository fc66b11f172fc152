"""Read a Hugging Face ``config.json`` into a :class:`ModelSpec` (plain JSON; no transformers).

Key names are those of the transformers configuration classes: ``LlamaConfig`` (also Mistral,
Qwen2, Qwen3), ``MixtralConfig`` (``num_local_experts``, ``num_experts_per_tok``),
``Qwen2MoeConfig`` (``num_experts``, ``moe_intermediate_size``,
``shared_expert_intermediate_size``, ``decoder_sparse_step``) and ``GPT2Config`` (``n_embd``,
``n_layer``, ``n_head``, ``n_positions``, ``n_inner``), ``DeepseekV3Config`` (multi-latent
attention, also Kimi K2) and ``GptOssConfig``. Defaults for absent keys are those
classes' defaults (``tie_word_embeddings``: False for Llama-family, True for GPT-2).
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..errors import PlanError
from ..fields import json_value

_LLAMA_FAMILY = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
_GELU = ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast")
_DEEPSEEK = ("deepseek_v2", "deepseek_v3", "kimi_k2")


def spec_from_hf_config(cls: type, path: "str | Path | dict", *, name: str | None = None,
                        seq_length: int | None = None):
    if isinstance(path, dict):
        cfg, source = path, "config"
    else:
        source = str(path)
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        try:
            cfg = json.loads(p.read_text())
        except FileNotFoundError:
            raise PlanError(f"model: no such config file {source!r}") from None
        except json.JSONDecodeError as exc:
            raise PlanError(f"{source}: not valid JSON: {exc}") from None
        if not isinstance(cfg, dict):
            raise PlanError(f"{source}: a config.json holds a JSON object")
    check_hf_config(cfg, source)
    kind = str(cfg.get("model_type", "")).lower()
    # the family and the whole config ride along: an executor builds that family's modules
    # from them (what the shape does not hold: rope theta, norm epsilon, init range...)
    origin = {"family": kind or None, "hf_config": dict(cfg)}
    if kind in _DEEPSEEK or "kv_lora_rank" in cfg:
        return replace(_deepseek(cls, cfg, source, name or kind or "hf-model", seq_length),
                       **origin)
    if kind == "gpt_oss":
        return replace(_gpt_oss(cls, cfg, source, name or kind, seq_length), **origin)
    if kind == "gpt2" or "n_embd" in cfg:
        return replace(_gpt2(cls, cfg, source, name, seq_length), **origin)
    if kind in _LLAMA_FAMILY or "num_key_value_heads" in cfg or "intermediate_size" in cfg:
        return replace(_llama(cls, cfg, source, name or kind or "hf-model", seq_length), **origin)
    raise PlanError(f"{source}: model_type {kind!r} is not supported; from_hf_config reads "
                    f"Llama-family ({', '.join(_LLAMA_FAMILY)}) and GPT-2 configs")


# config.json keys read here or by the families' modules, and the JSON type and range each
# must have (key -> (kind, low, strict)): a value of another type is refused rather than read
# as another model (``"tie_word_embeddings": "false"`` is a string, which would tie).
_POSITIVE = ("int", 1, False)
_COUNT = ("int", 0, False)
_FLAG = ("bool", None, False)
_ABOVE_ZERO = ("number", 0, True)
_NON_NEGATIVE = ("number", 0, False)
HF_KEYS: dict[str, tuple[str, float | None, bool]] = {
    **{k: _POSITIVE for k in ("hidden_size", "num_attention_heads", "num_hidden_layers",
                              "vocab_size", "intermediate_size", "num_key_value_heads",
                              "head_dim", "max_position_embeddings", "moe_intermediate_size",
                              "num_experts_per_tok", "decoder_sparse_step", "n_embd", "n_layer", "n_head", "n_positions", "n_inner")},
    # (a sliding window of 0 is none: Qwen2-MoE writes it with use_sliding_window false)
    **{k: _COUNT for k in ("num_local_experts", "num_experts", "max_window_layers",
                           "shared_expert_intermediate_size", "sliding_window")},
    **{k: _FLAG for k in ("tie_word_embeddings", "mlp_bias", "attention_bias", "qkv_bias",
                          "use_sliding_window", "output_router_logits", "norm_topk_prob",
                          "scale_attn_weights", "scale_attn_by_inverse_layer_idx",
                          "reorder_and_upcast_attn")},
    **{k: _ABOVE_ZERO for k in ("rms_norm_eps", "layer_norm_epsilon", "rope_theta")},
    **{k: _NON_NEGATIVE for k in ("initializer_range", "attention_dropout", "resid_pdrop",
                                  "embd_pdrop", "attn_pdrop", "router_aux_loss_coef",
                                  "router_jitter_noise", "partial_rotary_factor")},
    **{k: ("str", None, False) for k in ("model_type", "hidden_act", "activation_function")},
}
# transformers' activation names (transformers.activations.ACT2FN, 5.x)
HF_ACTIVATIONS = ("gelu", "gelu_10", "gelu_accurate", "gelu_fast", "gelu_new", "gelu_python",
                  "gelu_python_tanh", "gelu_pytorch_tanh", "hardswish", "laplace", "leaky_relu",
                  "linear", "mish", "prelu", "quick_gelu", "relu", "relu2", "relu6", "sigmoid",
                  "silu", "sqrtsoftplus", "swish", "tanh", "xielu")
# keys a value null stands for "the family's default" (the others need a value when present)
_NULLABLE = ("num_key_value_heads", "head_dim", "sliding_window", "n_inner", "num_experts_per_tok",
             "moe_intermediate_size", "shared_expert_intermediate_size", "num_local_experts",
             "num_experts", "max_window_layers", "decoder_sparse_step", "rope_theta")


def check_hf_config(cfg: dict, source: str) -> None:
    """Refuse a config.json value of the wrong JSON type or out of range, and a shape its
    family cannot build, naming the key: here, before any process starts, rather than as a
    model other than the one written (a string "false" that ties, 0 kv heads read as "all")
    or as transformers' validator failing inside a worker."""
    for key, (kind, low, strict) in HF_KEYS.items():
        if key in cfg:
            json_value(cfg[key], kind, key, source, PlanError, optional=key in _NULLABLE,
                       low=low, strict=strict)
    rope = cfg.get("rope_parameters", cfg.get("rope_scaling"))
    if isinstance(rope, dict) and "rope_theta" in rope:
        json_value(rope["rope_theta"], "number", "rope_parameters.rope_theta", source,
                   PlanError, low=0, strict=True)
    for key in ("hidden_act", "activation_function"):
        if key in cfg and cfg[key].lower() not in HF_ACTIVATIONS:
            raise PlanError(f"{source}: {key} {cfg[key]!r} is not an activation transformers "
                            f"knows ({', '.join(HF_ACTIVATIONS)})")
    gpt2 = str(cfg.get("model_type", "")).lower() == "gpt2" or "n_embd" in cfg
    hidden, heads = (("n_embd", "n_head") if gpt2 else ("hidden_size", "num_attention_heads"))
    if isinstance(cfg.get(hidden), int) and isinstance(cfg.get(heads), int):
        h, n = cfg[hidden], cfg[heads]
        if h % n:
            raise PlanError(f"{source}: {hidden} = {h} is not a multiple of {heads} = {n} "
                            "(each attention head is hidden / heads wide)")
        kv = cfg.get("num_key_value_heads")
        if not gpt2 and kv is not None and n % kv:
            raise PlanError(f"{source}: num_attention_heads = {n} is not a multiple of "
                            f"num_key_value_heads = {kv} (grouped-query attention shares each "
                            "key/value head among heads / kv_heads query heads)")
        dim = cfg.get("head_dim") or h // n
        if not gpt2 and dim % 2:
            raise PlanError(f"{source}: head_dim = {dim} is odd; rotary position embeddings "
                            "rotate pairs of channels, so each head needs an even width")


def _need(cfg: dict, key: str, source: str) -> Any:
    if key not in cfg:
        raise PlanError(f"{source}: config.json has no {key!r}")
    return cfg[key]


def _llama(cls: type, cfg: dict, source: str, name: str, seq_length: int | None):
    hidden = _need(cfg, "hidden_size", source)
    heads = _need(cfg, "num_attention_heads", source)
    act = str(cfg.get("hidden_act", "silu")).lower()
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0) if experts else 0
    ffn = _need(cfg, "intermediate_size", source)
    moe_ffn = cfg.get("moe_intermediate_size", ffn) if experts else None
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if experts else 0
    return cls(
        name=name, layers=_need(cfg, "num_hidden_layers", source), hidden=hidden, heads=heads,
        seq_length=int(seq_length or cfg.get("max_position_embeddings", 4096)),
        vocab=_need(cfg, "vocab_size", source),
        kv_heads=heads if cfg.get("num_key_value_heads") is None else cfg["num_key_value_heads"],
        head_dim=None if cfg.get("head_dim") in (None, hidden // heads) else cfg["head_dim"],
        ffn_hidden=ffn, mlp="gelu" if act in _GELU else "swiglu", norm="rmsnorm",
        position="rotary", tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bias=bool(cfg.get("mlp_bias", False)),
        qkv_bias=None if _qkv_bias(cfg) == bool(cfg.get("mlp_bias", False)) else _qkv_bias(cfg),
        dropout=float(cfg.get("attention_dropout", 0.0)) > 0,
        experts=experts, top_k=top_k, moe_ffn_hidden=moe_ffn, shared_expert_ffn_hidden=shared,
        moe_layer_freq=int(cfg.get("decoder_sparse_step", 1) or 1),
        # Qwen2-MoE's shared expert has a sigmoid gate (hidden -> 1)
        shared_expert_gate=bool(shared) and str(cfg.get("model_type", "")).lower() == "qwen2_moe",
        # Qwen3's attention normalises each head's q and k (q_norm, k_norm: head_dim each)
        qk_norm=str(cfg.get("model_type", "")).lower() in ("qwen3", "qwen3_moe"),
    )


def _deepseek(cls: type, cfg: dict, source: str, name: str, seq_length: int | None):
    """DeepSeek-V2/V3 (and Kimi K2, its architecture): multi-latent attention
    (``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
    ``v_head_dim``), ``n_routed_experts`` of ``moe_intermediate_size`` with
    ``n_shared_experts`` as one shared expert, the first ``first_k_dense_replace`` layers dense,
    ``num_nextn_predict_layers`` multi-token-prediction modules."""
    heads = _need(cfg, "num_attention_heads", source)
    experts = int(cfg.get("n_routed_experts") or 0)
    moe_ffn = int(_need(cfg, "moe_intermediate_size", source)) if experts else None
    return cls(
        name=name, layers=_need(cfg, "num_hidden_layers", source),
        hidden=_need(cfg, "hidden_size", source), heads=heads,
        seq_length=int(seq_length or cfg.get("max_position_embeddings", 4096)),
        vocab=_need(cfg, "vocab_size", source), kv_heads=heads,
        head_dim=int(_need(cfg, "qk_nope_head_dim", source)),
        ffn_hidden=_need(cfg, "intermediate_size", source), mlp="swiglu", norm="rmsnorm",
        position="rotary", tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bias=bool(cfg.get("attention_bias", False)), dropout=False,
        experts=experts, top_k=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
        moe_ffn_hidden=moe_ffn,
        shared_expert_ffn_hidden=int(cfg.get("n_shared_experts") or 0) * (moe_ffn or 0),
        moe_layer_freq=int(cfg.get("moe_layer_freq", 1) or 1),
        first_dense_layers=int(cfg.get("first_k_dense_replace", 0) or 0),
        q_lora_rank=cfg.get("q_lora_rank") or None,
        kv_lora_rank=int(_need(cfg, "kv_lora_rank", source)),
        qk_rope_head_dim=int(_need(cfg, "qk_rope_head_dim", source)),
        v_head_dim=int(_need(cfg, "v_head_dim", source)),
        mtp_layers=int(cfg.get("num_nextn_predict_layers", 0) or 0),
    )


def _gpt_oss(cls: type, cfg: dict, source: str, name: str, seq_length: int | None):
    """OpenAI's gpt-oss: ``num_local_experts`` with biases, a bias on every attention
    projection (``attention_bias``), sink logits per head, ``sliding_window`` on the layers
    ``layer_types`` names ``sliding_attention``."""
    layers = _need(cfg, "num_hidden_layers", source)
    types = cfg.get("layer_types") or []
    window = int(cfg.get("sliding_window") or 0)
    return cls(
        name=name, layers=layers, hidden=_need(cfg, "hidden_size", source),
        heads=_need(cfg, "num_attention_heads", source),
        seq_length=int(seq_length or cfg.get("max_position_embeddings", 4096)),
        vocab=_need(cfg, "vocab_size", source),
        kv_heads=_need(cfg, "num_key_value_heads", source),
        head_dim=int(_need(cfg, "head_dim", source)),
        ffn_hidden=_need(cfg, "intermediate_size", source), mlp="swiglu", norm="rmsnorm",
        position="rotary", tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bias=bool(cfg.get("attention_bias", True)), dropout=False,
        experts=int(_need(cfg, "num_local_experts", source)),
        top_k=int(_need(cfg, "num_experts_per_tok", source)),
        moe_ffn_hidden=_need(cfg, "intermediate_size", source), moe_bias=True,
        attention_sinks=True, sliding_window=window,
        sliding_window_layers=sum(t == "sliding_attention" for t in types) if window else 0,
    )


def _qkv_bias(cfg: dict) -> bool:
    """Whether the q, k, v projections have biases: always in Qwen2 (and Qwen2-MoE), as
    ``attention_bias`` says in Llama and Mistral (whose o projection then has one too, which
    ``bias`` = ``mlp_bias`` does not count: hidden parameters a layer), never in the others."""
    kind = str(cfg.get("model_type", "")).lower()
    if kind == "qwen2_moe":
        return bool(cfg.get("qkv_bias", True))       # Qwen2MoeConfig.qkv_bias
    if kind == "qwen2":
        return True
    return bool(cfg.get("attention_bias", False)) if kind in ("llama", "mistral") else False


def _gpt2(cls: type, cfg: dict, source: str, name: str | None, seq_length: int | None):
    hidden = _need(cfg, "n_embd", source)
    positions = int(cfg.get("n_positions", 1024))
    return cls(
        name=name or "gpt2", layers=_need(cfg, "n_layer", source), hidden=hidden,
        heads=_need(cfg, "n_head", source), seq_length=int(seq_length or positions),
        vocab=_need(cfg, "vocab_size", source), ffn_hidden=cfg.get("n_inner") or 4 * hidden,
        mlp="gelu", norm="layernorm", position="learned",
        tied_embeddings=bool(cfg.get("tie_word_embeddings", True)), bias=True,
        # GPT2Config's dropout probabilities (each 0.1 by default)
        dropout=any(float(cfg.get(k, 0.1)) > 0 for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")),
        max_position=positions,
    )


# the spec's shape fields and the config.json keys they are, per family (`hf_config_for`)
_LLAMA_KEYS = {"layers": "num_hidden_layers", "hidden": "hidden_size",
               "heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
               "vocab": "vocab_size", "tied_embeddings": "tie_word_embeddings"}
_GPT2_KEYS = {"layers": "n_layer", "hidden": "n_embd", "heads": "n_head", "vocab": "vocab_size",
              "tied_embeddings": "tie_word_embeddings"}
def hf_config_for(model: Any) -> dict:
    """The config.json a family's model (``ModelSpec.family``) is built from: its stored
    ``hf_config`` (or the family's defaults) with the spec's shape written in, so a plan whose
    shape was changed after it was read (``--layers 4``) builds that shape; what `pipesim
    models NAME --config-out DIR` writes, and what pipeexec builds the family's modules from."""
    cfg = dict(model.hf_config or {})
    cfg["model_type"] = model.family
    gpt2 = model.family == "gpt2"
    for field, key in (_GPT2_KEYS if gpt2 else _LLAMA_KEYS).items():
        cfg[key] = getattr(model, field)
    if gpt2:
        cfg["n_inner"] = None if model.ffn == 4 * model.hidden else model.ffn
        cfg["n_positions"] = model.max_position or model.seq_length
    else:
        if model.family in ("qwen2_moe", "qwen3_moe"):
            cfg["intermediate_size"] = model.ffn
            cfg["moe_intermediate_size"] = model.moe_ffn
            cfg["num_experts"], cfg["num_experts_per_tok"] = model.experts, model.top_k
            cfg.pop("num_local_experts", None)          # Qwen3MoeConfig's alias of num_experts
            cfg["decoder_sparse_step"] = model.moe_layer_freq
            if model.family == "qwen2_moe":
                cfg["shared_expert_intermediate_size"] = model.shared_expert_ffn_hidden
                cfg["qkv_bias"] = model.bias if model.qkv_bias is None else model.qkv_bias
        elif model.is_moe:
            cfg["intermediate_size"] = model.moe_ffn
            cfg["num_local_experts"], cfg["num_experts_per_tok"] = model.experts, model.top_k
        else:
            cfg["intermediate_size"] = model.ffn
        if model.head_dim is not None or "head_dim" in cfg:
            cfg["head_dim"] = model.kv_channels
    if len(cfg.get("layer_types") or [None] * model.layers) != model.layers:
        del cfg["layer_types"]        # per-layer attention kinds of another depth: the default
    return cfg
