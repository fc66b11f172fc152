"""``pipeexec checkpoint export-hf CKPT OUT_DIR``: a checkpoint of any layout as a Hugging Face
model directory (``config.json``, ``model.safetensors`` or shards with
``model.safetensors.index.json``, and the run's tokenizer files when it recorded one), which
``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads and ``pipeexec train --hf-model
OUT_DIR`` trains on from.

The checkpoint reader puts every tensor back together whatever wrote it (pp, vpp, dualpipe's
copies, tp shards, ep's experts, ZeRO's gathered masters, cp and dp replicas: all saved by
global name), so export is a renaming of whole fp32 tensors:

* a Hugging Face family pipeexec trains (Llama, Mistral, Qwen2, Mixtral, Qwen2-/Qwen3-MoE,
  GPT-2): the layers are the family's own modules, and each name is `models.hf.hf_name`'s,
  the very mapping ``--hf-model`` loads by (a tied head is the embedding: written once, as
  ``save_pretrained`` writes it); the config is the run's plan's model as the family's
  config.json (`models.hf_config.config_for`);
* the built-in GPT: a GPT-2 (``GPT2LMHeadModel``) with exact GeLU (``activation_function =
  "gelu"``), LayerNorm epsilon 1e-5, no dropout, the run's position table as ``n_positions``
  and its MLP width as ``n_inner``; GPT-2's Conv1D weights are the transposes of pipeexec's
  Linear ones (`GPT_TO_GPT2`). A model GPT-2 cannot say is refused with the reason.

Every name written is checked against the transformers model built from the written config
(on the meta device): the same keys and shapes, or the export is refused naming the first
difference. The directory is written under a temporary name and renamed into place, so a
failed export leaves no half-written model; an existing ``OUT_DIR`` is refused unless
``force``.
"""
from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .contents import layer_of, model_chunks
from .convert import config_from_dict
from .errors import CheckpointError
from .layout import Tag, tag_dir_name
from .reader import CheckpointReader

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MAX_SHARD_BYTES = 5 * 1024 ** 3        # save_pretrained's default shard size: 5 GB
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# what a tokenizer directory may hold that from_pretrained reads
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                   "chat_template.jinja", "generation_config.json")

# The built-in GPT's layer names -> GPT-2's ({i}: the block's index among the blocks), and
# whether the tensor is transposed (GPT-2's Conv1D holds weight (in, out), a Linear (out, in)).
GPT_TO_GPT2: dict[str, tuple[str, bool]] = {
    "embedding.tok": ("transformer.wte.weight", False),
    "embedding.pos": ("transformer.wpe.weight", False),
    "block.ln1.weight": ("transformer.h.{i}.ln_1.weight", False),
    "block.ln1.bias": ("transformer.h.{i}.ln_1.bias", False),
    "block.qkv.weight": ("transformer.h.{i}.attn.c_attn.weight", True),
    "block.qkv.bias": ("transformer.h.{i}.attn.c_attn.bias", False),
    "block.proj.weight": ("transformer.h.{i}.attn.c_proj.weight", True),
    "block.proj.bias": ("transformer.h.{i}.attn.c_proj.bias", False),
    "block.ln2.weight": ("transformer.h.{i}.ln_2.weight", False),
    "block.ln2.bias": ("transformer.h.{i}.ln_2.bias", False),
    "block.fc1.weight": ("transformer.h.{i}.mlp.c_fc.weight", True),
    "block.fc1.bias": ("transformer.h.{i}.mlp.c_fc.bias", False),
    "block.fc2.weight": ("transformer.h.{i}.mlp.c_proj.weight", True),
    "block.fc2.bias": ("transformer.h.{i}.mlp.c_proj.bias", False),
    "head.norm.weight": ("transformer.ln_f.weight", False),
    "head.norm.bias": ("transformer.ln_f.bias", False),
    "head.lm_head.weight": ("lm_head.weight", False),
}


@dataclass
class ExportReport:
    tag: Tag
    out_dir: str
    model_type: str
    files: list[str] = field(default_factory=list)
    tensors: int = 0
    bytes: int = 0
    notes: list[str] = field(default_factory=list)


def _require(package: str, why: str) -> Any:
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError:
        raise CheckpointError(f"export-hf needs the {package} package ({why}): pip install "
                              f"{package}, or pip install 'pipesim[hf]'") from None


def whole_model(reader: CheckpointReader) -> dict[str, torch.Tensor]:
    """Every model tensor of the checkpoint by global name, whole (tp shards and ep experts
    put together), each once (a model part's copies are saved once)."""
    model: dict[str, torch.Tensor] = {}
    for r in range(reader.pp):
        f = reader.file(r)
        for c, chunk in enumerate(model_chunks(f, str(reader.path(r)))):
            for key in chunk:
                model[key] = reader.whole(r, key, lambda g, c=c, key=key: model_chunks(g)[c][key])
    num_layers = int(reader.layout["num_layers"])
    present = sorted({layer_of(n) for n in model})
    if present != list(range(num_layers)):
        raise CheckpointError(f"the checkpoint's model state covers layers {present}, expected "
                              f"0..{num_layers - 1}", path=reader.dir, field="model")
    return model


def gpt2_config(model: Any) -> dict[str, Any]:
    """GPT-2's config.json for the built-in GPT of ``model`` (a `pipesim.ModelSpec` without a
    family); CheckpointError with the reason when GPT-2 cannot say it."""
    from ..models import gpt_differences

    refused = gpt_differences(model)
    if refused:
        raise CheckpointError("the built-in GPT of this checkpoint is no GPT-2: "
                              + "; ".join(refused), field="config")
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
            "vocab_size": model.vocab, "n_positions": model.max_position or model.seq_length,
            "n_embd": model.hidden, "n_layer": model.layers, "n_head": model.heads,
            "n_inner": None if model.ffn == 4 * model.hidden else model.ffn,
            "activation_function": "gelu", "layer_norm_epsilon": 1e-5,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, "tie_word_embeddings": model.tied_embeddings,
            "initializer_range": 0.02, "bos_token_id": None, "eos_token_id": None}


def gpt2_tensors(model: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The built-in GPT's tensors under GPT-2's names (`GPT_TO_GPT2`)."""
    n = model.layers
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        i, local = layer_of(name), name.split(".", 2)[2]
        kind = "embedding" if i == 0 else "head" if i == n + 1 else "block"
        entry = GPT_TO_GPT2.get(f"{kind}.{local}")
        if entry is None:
            raise CheckpointError(f"no GPT-2 name for the built-in GPT's {name!r}", field=name)
        key, transpose = entry
        if kind == "head" and local == "lm_head.weight" and model.tied_embeddings:
            continue                     # tied: GPT-2's head is its wte
        out[key.format(i=i - 1)] = t.t() if transpose else t
    return out


def family_tensors(model: Any, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Hugging Face family's tensors under its own names (`hf_name`: the mapping
    ``--hf-model`` loads by); a tied head is written once, as the embedding."""
    from ..models.hf import hf_name

    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        key = hf_name(model.family, model.layers, name)
        if model.tied_embeddings and key == "lm_head.weight":
            continue
        out[key] = t
    return out


def family_config(model: Any) -> dict[str, Any]:
    """The family's config.json of the run's model (the spec's shape written into its
    stored config: `config_for`)."""
    from ..models.hf_config import SUPPORTED, config_for

    cfg = config_for(model)
    cfg["architectures"] = [SUPPORTED[model.family]]
    return cfg


def _check_against_transformers(config_json: dict[str, Any], tensors: dict[str, torch.Tensor]
                                ) -> Any:
    """The transformers config of ``config_json``; CheckpointError unless the model it
    builds has exactly ``tensors``' names and shapes (a tied head aside)."""
    transformers = _require("transformers", "the Hugging Face config and model classes")
    values = {k: v for k, v in config_json.items()
              if k not in ("model_type", "transformers_version")}
    config = transformers.AutoConfig.for_model(config_json["model_type"], **values)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config)
    expected = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        expected.pop("lm_head.weight", None)
    ours = {k: tuple(v.shape) for k, v in tensors.items()}
    missing = sorted(set(expected) - set(ours))
    unexpected = sorted(set(ours) - set(expected))
    wrong = sorted(k for k in set(ours) & set(expected) if ours[k] != expected[k])
    if missing or unexpected or wrong:
        parts = ([f"missing {missing[:3]}"] if missing else []) + (
            [f"unexpected {unexpected[:3]}"] if unexpected else []) + (
            [f"{k}: shape {ours[k]}, {type(hf).__name__} has {expected[k]}" for k in wrong[:3]])
        raise CheckpointError(f"the exported tensors do not fit {type(hf).__name__} of "
                              f"transformers {transformers.__version__}: " + "; ".join(parts))
    return config, [k for k in hf.state_dict() if k in tensors]


def shard_plan(order: list[str], sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Names grouped into files of at most ``max_bytes`` each (a tensor larger than that
    alone in its file), in ``order``."""
    shards: list[list[str]] = [[]]
    used = 0
    for name in order:
        if shards[-1] and used + sizes[name] > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += sizes[name]
    return shards


def write_safetensors(directory: Path, tensors: dict[str, torch.Tensor], order: list[str],
                      max_bytes: int) -> list[str]:
    """``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` files with
    ``model.safetensors.index.json`` above ``max_bytes`` (save_pretrained's names)."""
    from safetensors.torch import save_file

    sizes = {n: tensors[n].numel() * tensors[n].element_size() for n in order}
    shards = shard_plan(order, sizes, max_bytes)
    files = ([SINGLE_FILE] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    for names, file in zip(shards, files):
        save_file(_unshared({n: tensors[n] for n in names}), str(directory / file),
                  metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())},
                 "weight_map": {n: file for names, file in zip(shards, files) for n in names}}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        files.append(INDEX_FILE)
    return files


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors, none sharing memory with another (safetensors refuses shared
    storage): a copy only where two would share it."""
    seen: set[int] = set()
    out = {}
    for name, t in tensors.items():
        t = t.detach().contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def copy_tokenizer(source: str | Path, directory: Path) -> list[str]:
    """The tokenizer files of the directory ``source`` copied into ``directory``."""
    src = Path(source)
    if not src.is_dir():
        raise CheckpointError(f"the run's tokenizer directory {source} does not exist (the "
                              "config records it); export without it is refused: restore it")
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, directory / name)
            copied.append(name)
    if not copied:
        raise CheckpointError(f"the run's tokenizer directory {source} holds none of "
                              f"{', '.join(TOKENIZER_FILES)}")
    return copied


def export_hf(ckpt: str | Path, out_dir: str | Path, *, tag: Tag | None = None,
              force: bool = False, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
              dtype: str = "float32", log: Callable[[str], None] | None = None) -> ExportReport:
    """Write checkpoint ``tag`` of ``ckpt`` (default: the tracker's) as the Hugging Face model
    directory ``out_dir`` (see the module docstring); ``dtype``: the written tensors' (the
    checkpoint's fp32 weights, rounded to bfloat16 or float16 when asked)."""
    out = Path(out_dir)
    if out.exists() and not force:
        raise CheckpointError("the target exists; give another directory, or --force to "
                              "replace it", path=out)
    if out.exists() and not out.is_dir():
        raise CheckpointError("the target exists and is not a directory", path=out)
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) \
            or max_shard_bytes < 1:
        raise CheckpointError(f"--max-shard-size must be a positive number of bytes, got "
                              f"{max_shard_bytes!r}")
    if dtype not in DTYPES:
        raise CheckpointError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    _require("safetensors", "model.safetensors is written with it")
    reader = CheckpointReader(ckpt, tag)
    config, notes = config_from_dict(reader.config, path=str(reader.path(0)))
    model = config.plan.model
    tensors = whole_model(reader)
    if model.family is None:
        config_json = gpt2_config(model)
        named = gpt2_tensors(model, tensors)
        notes.append("the built-in GPT written as a GPT-2 (exact GeLU, no dropout)")
    else:
        config_json = family_config(model)
        named = family_tensors(model, tensors)
    hf_config, order = _check_against_transformers(config_json, named)
    hf_config.architectures = list(config_json["architectures"])
    if dtype != "float32":
        named = {k: t.to(DTYPES[dtype]) for k, t in named.items()}
    hf_config.dtype = dtype
    tokenizer = reader.config.get("tokenizer")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        hf_config.save_pretrained(str(tmp))
        files = ["config.json"] + write_safetensors(tmp, named, order, max_shard_bytes)
        if isinstance(tokenizer, str) and tokenizer:
            files += copy_tokenizer(tokenizer, tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    report = ExportReport(reader.tag, str(out), config_json["model_type"], files, len(named),
                          sum(t.numel() * t.element_size() for t in named.values()), notes)
    if log is not None:
        log(f"checkpoint: exported {tag_dir_name(reader.tag)} of {reader.root} (tp="
            f"{reader.tp} pp={reader.pp} ep={reader.ep}) as a Hugging Face "
            f"{report.model_type} to {out}: {report.tensors} tensors, "
            f"{report.bytes / 2 ** 20:.2f} MiB in {', '.join(files)}"
            + (f"; notes: {'; '.join(notes)}" if notes else ""))
    return report
