"""Hugging Face models from a plan's `ModelSpec` or a model directory, read without torch or
transformers.

A plan's model of a Hugging Face family (``ModelSpec.family``, ``ModelSpec.hf_config``: what
``ModelSpec.from_hf_config`` reads from a config.json) is built from the config the spec
spells (`config_for`): the stored config.json with the spec's shape written into it, so the
spec is the one copy of the shape and the config supplies the rest (rope theta, norm epsilon,
initializer range...); what the family's config cannot say of the spec is refused
(`spec_differences`). ``--hf-model DIR`` makes the plan's model from DIR's config.json
(`plan_model_of`) and loads DIR's safetensors. Everything is checked here, before any worker
starts: a supported architecture (`SUPPORTED`), GPT-2's learned positions bounding the sequence
length, a Qwen2-MoE whose dense layers the plan's spec can say (`_moe_refusals`). The routers'
load-balancing loss (``output_router_logits = true``) runs as Hugging Face computes it
(`hf_router_loss`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipesim.errors import PlanError
from pipesim.plan.hf_config import check_hf_config
from pipesim.plan.hf_config import hf_config_for as config_for
from pipesim.plan.model import ModelSpec

# config.json model_type -> the family's transformers classes (documentation and error text)
SUPPORTED = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}


def modeling_module(model_type: str) -> str:
    """The transformers module holding a family's classes (its decoder layer, rotary
    embedding), imported where a rank builds its layers."""
    return f"transformers.models.{model_type}.modeling_{model_type}"


class HFModelError(ValueError):
    """A Hugging Face model directory that cannot run, naming the file and what to do."""


@dataclass(frozen=True)
class HFModelInfo:
    path: str                      # the directory
    model_type: str
    layers: int                    # decoder layers (the layer list adds embedding and head)
    hidden: int
    heads: int
    vocab: int
    max_positions: int | None      # learned positions (GPT-2): the longest sequence
    tied_embeddings: bool
    checkpoint_files: tuple[str, ...]   # *.safetensors in the directory (sorted); () = random init
    config: dict                   # config.json as read


# TrainConfig fields a Hugging Face config.json sets (flags refused next to --hf-model)
HF_FIELDS = ("layers", "hidden", "heads", "kv_heads", "vocab", "ffn_hidden", "tie_embeddings")


def read_hf_config(path: str | Path) -> HFModelInfo:
    """Read and check ``path`` (a directory holding ``config.json``, or that file itself)."""
    directory, file, cfg = _read_dir(path)
    return info_from_config(cfg, str(directory), weight_files(directory), source=file)


def weight_files(path: str | Path) -> tuple[str, ...]:
    """The ``*.safetensors`` of the model directory ``path`` (or of the directory of its
    config.json), sorted; () when it has none (random init). Reads no config.json: a rank
    building a validated run's model needs only its weights."""
    p = Path(path)
    directory = p.parent if p.name == "config.json" else p
    return tuple(sorted(str(f) for f in directory.glob("*.safetensors")))


def _read_dir(path: str | Path) -> tuple[Path, Path, dict]:
    p = Path(path)
    directory = p.parent if p.name == "config.json" else p
    file = directory / "config.json"
    if not directory.is_dir():
        raise HFModelError(f"--hf-model {path}: no such directory (a Hugging Face model "
                           "directory: config.json, optionally *.safetensors)")
    if not file.is_file():
        raise HFModelError(f"--hf-model {path}: {file} does not exist (a Hugging Face model "
                           "directory holds config.json)")
    try:
        cfg = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise HFModelError(f"{file}: not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise HFModelError(f"{file}: config.json holds a JSON object")
    return directory, file, cfg


def info_from_config(cfg: dict, path: str, checkpoint_files: tuple[str, ...] = (), *,
                     source: Any = None) -> HFModelInfo:
    """Check a config.json's contents (``source`` names it in errors) and read its shape;
    ``path``: the directory it came from (or the plan naming it), ``checkpoint_files``: its
    weights (none: random init)."""
    file = source if source is not None else f"{path}: model.hf_config"
    try:
        check_hf_config(cfg, str(file))        # JSON types, ranges, a shape the family builds
    except PlanError as exc:
        raise HFModelError(str(exc)) from None
    kind = str(cfg.get("model_type", ""))
    if kind not in SUPPORTED:
        raise HFModelError(f"{file}: model_type {kind!r} is not supported; pipeexec runs "
                           + ", ".join(f"{k} ({v})" for k, v in SUPPORTED.items()))
    refused = _moe_refusals(cfg, kind)
    if refused:
        raise HFModelError(f"{file}: " + "; ".join(refused))
    if kind == "gpt2":
        fields = dict(layers=_need(cfg, "n_layer", file), hidden=_need(cfg, "n_embd", file),
                      heads=_need(cfg, "n_head", file))
        max_positions = int(cfg.get("n_positions", 1024))
        tied = bool(cfg.get("tie_word_embeddings", True))
    else:
        fields = dict(layers=_need(cfg, "num_hidden_layers", file),
                      hidden=_need(cfg, "hidden_size", file),
                      heads=_need(cfg, "num_attention_heads", file))
        _need(cfg, "intermediate_size", file)
        max_positions = None
        tied = bool(cfg.get("tie_word_embeddings", False))
    vocab = _need(cfg, "vocab_size", file)
    for name, value in (*fields.items(), ("vocab", vocab)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise HFModelError(f"{file}: {name} must be a positive integer, got {value!r}")
    return HFModelInfo(str(path), kind, fields["layers"], fields["hidden"], fields["heads"],
                       vocab, max_positions, tied, tuple(checkpoint_files), cfg)


def _moe_refusals(cfg: dict, kind: str) -> list[str]:
    """What of a MoE config does not run as the unsplit model: Mixtral's router jitter (random
    noise), what of a Qwen2-/Qwen3-MoE config the plan's `ModelSpec` cannot say (its cost
    model would place the MoE layers elsewhere than the model does, or miss biases)."""
    out = []
    if kind == "mixtral" and float(cfg.get("router_jitter_noise", 0.0) or 0.0) > 0:
        out.append(f"router_jitter_noise = {cfg['router_jitter_noise']}: the router's input "
                   "noise would be drawn from each rank's generator (not as the unsplit model "
                   "draws it) and drawn again by recomputation; set it to 0")
    if kind not in ("qwen2_moe", "qwen3_moe"):
        return out
    if kind == "qwen3_moe" and cfg.get("attention_bias"):
        out.append("attention_bias = true: Qwen3-MoE's q, k, v and o projections would have "
                   "biases, which the plan's model (model.qkv_bias, model.bias) cannot say")
    if cfg.get("mlp_only_layers"):
        out.append(f"mlp_only_layers = {cfg['mlp_only_layers']!r}: the plan's model "
                   "(model.moe_layer_freq) cannot say which layers are dense; pipeexec runs "
                   "it with mlp_only_layers = []")
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    if step != 1:
        out.append(f"decoder_sparse_step = {step}: Hugging Face makes layer j sparse when "
                   f"(j + 1) % {step} == 0, the plan's model.moe_layer_freq when j % {step} == 0 "
                   "(Megatron's); pipeexec runs it with decoder_sparse_step = 1")
    if int(cfg.get("num_experts", cfg.get("num_local_experts", 1)) or 0) < 1:
        out.append("num_experts = 0: a dense model; use the family without experts")
    return out


def _need(cfg: dict, key: str, file: Any) -> Any:
    if key not in cfg:
        raise HFModelError(f"{file}: config.json has no {key!r}")
    return cfg[key]


# fields compared between a spec and the spec its config reads back as (not provenance, the
# name, or the vocabulary padding, which is the cost model's business: pipeexec never pads)
_NOT_SHAPE = ("name", "vocab_divisible_by", "family", "hf_config")


def spec_differences(model: Any) -> list[str]:
    """Where ``model`` (a family's `ModelSpec`) is not what its config (`config_for`) builds:
    each field, with both values (empty: the family builds exactly this shape)."""

    try:
        built = ModelSpec.from_hf_config(config_for(model), seq_length=model.seq_length)
    except PlanError as exc:
        return [f"model.hf_config: {exc}"]
    ours, theirs = model.to_dict(), built.to_dict()
    return [f"model.{k} = {ours[k]!r}: a {model.family} model of this config has {theirs[k]!r}"
            for k in ours if k not in _NOT_SHAPE and k != "max_position" and ours[k] != theirs[k]]


def plan_model_of(path: str | Path, *, seq_length: int) -> Any:
    """The plan's model for the Hugging Face directory ``path`` (checked: `read_hf_config`),
    read as ``pipesim simulate --model DIR/config.json`` reads it, at this sequence length and
    unpadded (pipeexec's tables are the config's size)."""

    info = read_hf_config(path)
    try:
        model = ModelSpec.from_hf_config(info.config, name=info.model_type, seq_length=seq_length)
    except PlanError as exc:
        raise HFModelError(f"--hf-model {path}: {exc}") from None
    return model.with_(vocab_divisible_by=1)


def model_refusals(model: Any, hf_model: str | None = None) -> list[str]:
    """Why a family's ``model`` cannot run (empty: it can): a family pipeexec does not build,
    a shape the family's config cannot say, a sequence longer than GPT-2's learned positions,
    or, with ``hf_model``, a model other than that directory's."""
    if model.family not in SUPPORTED:
        return [f"model.family = {model.family!r}: pipeexec builds the Hugging Face families "
                + ", ".join(SUPPORTED) + " and the built-in GPT (family null)"]
    try:
        info = info_from_config(config_for(model), hf_model or "the plan")
    except HFModelError as exc:
        return [str(exc)]
    out = spec_differences(model)
    if info.max_positions is not None and model.seq_length > info.max_positions:
        out.append(f"model.seq_length = {model.seq_length} (--seq-len) is longer than the "
                   f"model's {info.max_positions} learned positions (n_positions); give "
                   f"--seq-len {info.max_positions} or less")
    if hf_model is not None:
        try:
            theirs = plan_model_of(hf_model, seq_length=model.seq_length)
        except HFModelError as exc:
            return out + [str(exc)]
        ours, want = model.to_dict(), theirs.to_dict()
        out += [f"model.{k} = {ours[k]!r}: --hf-model {hf_model} has {want[k]!r}"
                for k in want if k not in _NOT_SHAPE and ours[k] != want[k]]
        if model.family != theirs.family:
            out.append(f"model.family = {model.family!r}: --hf-model {hf_model} is a "
                       f"{theirs.family} model")
    return out
