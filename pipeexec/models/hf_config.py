"""What a Hugging Face model directory holds, read without torch or transformers.

``pipeexec train --hf-model DIR`` checks the directory here, before any worker starts: its
``config.json`` exists and parses, names a supported architecture (`SUPPORTED`), and fits the
run (GPT-2's learned positions bound the sequence length; a Mixtral whose router loss is on
cannot be cut into a layer list). `HFModelInfo` is the shape the run's `TrainConfig` takes from
the file (layers, hidden, heads, vocab, tied embeddings), so the CLI's log, the layer count the layout is
checked against and the synthetic data's vocabulary are the model's.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# config.json model_type -> the family's transformers classes (documentation and error text)
SUPPORTED = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}


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

    def train_fields(self) -> dict[str, Any]:
        """The `TrainConfig` model fields this model sets."""
        return {"layers": self.layers, "hidden": self.hidden, "heads": self.heads,
                "vocab": self.vocab, "tie_embeddings": self.tied_embeddings}


# TrainConfig fields `HFModelInfo.train_fields` sets (flags refused next to --hf-model)
HF_FIELDS = ("layers", "hidden", "heads", "vocab", "ffn_mult", "tie_embeddings")


def read_hf_config(path: str | Path) -> HFModelInfo:
    """Read and check ``path`` (a directory holding ``config.json``, or that file itself)."""
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
    kind = str(cfg.get("model_type", ""))
    if kind not in SUPPORTED:
        raise HFModelError(f"{file}: model_type {kind!r} is not supported; pipeexec runs "
                           + ", ".join(f"{k} ({v})" for k, v in SUPPORTED.items()))
    if cfg.get("output_router_logits"):
        raise HFModelError(f"{file}: output_router_logits = true adds the router's load-"
                           "balancing loss of every layer to the head's loss, which a pipeline "
                           "stage cannot see; set it to false")
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
    files = tuple(sorted(str(f) for f in directory.glob("*.safetensors")))
    return HFModelInfo(str(directory), kind, fields["layers"], fields["hidden"], fields["heads"],
                       vocab, max_positions, tied, files, cfg)


def _need(cfg: dict, key: str, file: Path) -> Any:
    if key not in cfg:
        raise HFModelError(f"{file}: config.json has no {key!r}")
    return cfg[key]


def check_hf_run(info: HFModelInfo, *, seq_len: int, **fields: Any) -> None:
    """Raise HFModelError when a run's model ``fields`` (`HFModelInfo.train_fields`' names)
    disagree with the directory's model, or its sequences are longer than the model's learned
    positions."""
    for name, want in info.train_fields().items():
        got = fields[name]
        if got != want:
            raise HFModelError(f"--hf-model {info.path}: the run has {name} = {got}, its "
                               f"config.json {want} (with a Hugging Face model the shape comes "
                               f"from config.json: TrainConfig(...).with_hf_model(path))")
    if info.max_positions is not None and seq_len > info.max_positions:
        raise HFModelError(f"--hf-model {info.path}: --seq-len {seq_len} is longer than the "
                           f"model's {info.max_positions} learned positions (n_positions); "
                           f"pass --seq-len {info.max_positions} or less")
