"""What one rank's checkpoint file holds, and how it is made from and checked against a run.

One file per pipeline rank (Megatron's key names where Megatron has one):

==========================  =====================================================================
``checkpoint_version``      format version (`layout.CHECKPOINT_VERSION`)
``iteration``               optimizer iterations done (0 for a release checkpoint)
``release``                 True for a weights-only release checkpoint
``save_id``                 random id shared by all files of one save (mixed saves are refused)
``config``                  the run's `TrainConfig` as a dict (``asdict``)
``layout``                  the run's plan: tp, pp, vpp, dp, schedule (its name and, as
                            ``schedule_data``, the schedule itself: pipesim.schedule.io's dict),
                            this file's tp and pp rank, stage bounds, layer kinds, per chunk its
                            global stage and global layer indices, and ``shards``: each
                            tensor-parallel parameter's `ShardSpec` (the others are whole);
                            ``ep``, this file's ``ep_rank`` and ``experts``: the expert tensors,
                            their dim 0 this ep rank's E / ep experts (ep > 1: one file per
                            (tp, pp, ep) rank, `layout`)
``model`` / ``model0``...   per chunk: ``layers.<global layer>.<name>`` -> fp32 tensor (the fp32
                            master weights; for bf16/fp16 runs the 16-bit weights are their cast)
``optimizer``               ``state``: parameter name -> AdamW state (step, exp_avg, exp_avg_sq);
                            ``param_names``: this rank's parameters
``opt_param_scheduler``     ``num_updates`` (drives the LR) and the schedule's settings
``loss_scaler``             dynamic loss scale state
``rng_state``               one entry per data-parallel replica (`rng.capture_rng_state`)
``consumed_samples``        data position: samples of the global batches consumed so far
==========================  =====================================================================

Everything is keyed by global names (layer index, parameter name), never by rank or position,
so a different (pp, vpp, dp, schedule) can pick out the entries it needs.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from pipesim.schedule.io import schedule_to_dict

from .errors import CheckpointError
from .layout import CHECKPOINT_VERSION, chunk_key
from ..config import legacy_flat

# Config fields that define the model's tensors: a checkpoint only loads into the same values.
MODEL_FIELDS = ("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "seq_len",
                "tie_embeddings")
# Fields whose change makes a resumed run differ from the uninterrupted one (logged, allowed).
TRAINING_FIELDS = ("seed", "data", "lr", "min_lr", "warmup_steps", "decay_steps", "weight_decay",
                   "beta1", "beta2", "eps", "clip_grad", "precision", "micro_batch_size")
LAYOUT_FIELDS = ("tp", "sequence_parallel", "cp", "ep", "pp", "vpp", "dp", "zero", "schedule",
                 "microbatches", "partition", "boundaries")
# not in checkpoints of older pipeexecs
NEWER_FIELDS = ("tp", "sequence_parallel", "cp", "ep", "zero")


def layer_of(name: str) -> int:
    """Global layer index of a parameter named ``layers.<i>.<rest>``."""
    parts = name.split(".", 2)
    if len(parts) < 3 or parts[0] != "layers" or not parts[1].isdigit():
        raise ValueError(f"parameter name {name!r} is not of the form layers.<index>.<name>")
    return int(parts[1])


def chunk_stages(trainer) -> list[int]:
    """This rank's global stages in chunk order (the schedule's placement)."""
    return list(trainer.schedule.rank_stages(trainer.topology.pp_rank))


def saved_stages(schedule, pp_rank: int) -> list[int]:
    """The stages of ``pp_rank`` its file holds: all of them, less copies of a model part
    (dualpipe's second direction), which the rank holding the part's first stage saves: a
    tied parameter is saved once, so the checkpoint is the model's, loadable into any layout."""
    first: dict[int, int] = {}
    for s in range(schedule.num_stages):
        first.setdefault(schedule.stage_part(s), s)
    return [s for s in schedule.rank_stages(pp_rank) if first[schedule.stage_part(s)] == s]


def stage_layer_range(schedule, bounds: Sequence[int], stage: int) -> range:
    """Global layers of ``stage`` (those of the model part it computes)."""
    part = stage if schedule is None else schedule.stage_part(stage)
    return range(int(bounds[part]), int(bounds[part + 1]))


def layout_record(config, bounds: Sequence[int], stages: Sequence[int], pp_rank: int, *,
                  schedule: Any = None, layer_kinds: Sequence[str] | None = None,
                  tp_rank: int = 0, shards: Mapping[str, Any] | None = None,
                  ep_rank: int = 0, experts: Sequence[str] = ()) -> dict:
    """The ``layout`` entry. ``schedule``: the `pipesim.Schedule` that ran (stored as data, so
    a hand-made one is read back as itself, not rebuilt from ``config.schedule``); ``shards``:
    name -> `ShardSpec` of this file's tensor-parallel parameters; ``experts``: the names of
    its expert tensors (cut over ep along dim 0)."""
    par = config.plan.parallelism
    out = {"tp": int(par.tp), "tp_rank": int(tp_rank), "cp": int(par.cp),
           "shards": {n: spec.to_dict() for n, spec in (shards or {}).items()},
           "ep": int(par.ep), "ep_rank": int(ep_rank), "experts": sorted(experts),
           "pp": par.pp, "vpp": par.vpp, "dp": par.dp, "schedule": config.plan.schedule_name,
           "pp_rank": pp_rank, "bounds": [int(b) for b in bounds],
           "stages": [int(s) for s in stages],
           "layers": [list(stage_layer_range(schedule, bounds, s)) for s in stages],
           "num_layers": int(bounds[-1])}
    if schedule is not None:
        out["schedule_data"] = schedule_to_dict(schedule)
    if layer_kinds is not None:
        out["layer_kinds"] = [str(k) for k in layer_kinds]
    return out


def tensor_parallel_shards(trainer, stages: Sequence[int]) -> dict[str, Any]:
    """name -> `ShardSpec` of the tensor-parallel parameters of ``stages``."""
    from ..parallel.sharding import shard_spec
    return {n: shard_spec(p) for s in stages for n, p in trainer.stages[s].named_parameters()
            if shard_spec(p) is not None}


def expert_names(trainer, stages: Sequence[int]) -> list[str]:
    """The expert-parallel parameters of ``stages`` (their dim 0 this rank's experts)."""
    from ..models.hf_expert_parallel import is_expert
    return [n for s in stages for n, p in trainer.stages[s].named_parameters() if is_expert(p)]


def chunk_state(stage_module: torch.nn.Module, masters: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One chunk's model state: fp32 master of every parameter, plus persistent buffers."""
    out: dict[str, torch.Tensor] = {}
    for name, _ in stage_module.named_parameters():
        out[name] = masters[name].detach().to("cpu", copy=True)
    param_names = set(out)
    for name, value in stage_module.state_dict().items():
        if name not in param_names:
            out[name] = value.detach().to("cpu", copy=True)
    return out


def optimizer_record(trainer, names: set[str] | None = None,
                     opt_state: Mapping[str, Mapping[str, Any]] | None = None) -> dict:
    """AdamW state by parameter name (a parameter never stepped has no entry); ``names``:
    only these (the parameters this rank's file holds). ``opt_state``: the states by name,
    whole (`Trainer.full_state`, gathered under ZeRO); default: the trainer's."""
    if opt_state is None:
        opt_state = trainer.full_state()[1]
    state: dict[str, dict[str, Any]] = {}
    for name in trainer.param_names:
        if names is not None and name not in names:
            continue
        st = opt_state.get(name)
        if st:
            state[name] = {k: (v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v)
                           for k, v in st.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in trainer.optimizer.param_groups]
    held = [n for n in trainer.param_names if names is None or n in names]
    return {"state": state, "param_names": held, "param_groups": groups}


def scheduler_record(trainer) -> dict:
    opt = trainer.config.optimizer
    return {"num_updates": int(trainer.updates), "max_lr": opt.lr, "min_lr": opt.min_lr,
            "warmup_steps": opt.warmup_steps, "decay_steps": opt.decay_steps or opt.steps}


def rank_contents(trainer, *, release: bool = False,
                  state: tuple[Mapping[str, torch.Tensor], Mapping[str, Any]] | None = None) -> dict:
    """The file content of this rank, without ``rng_state`` (gathered over the dp group).
    ``state``: the trainer's `full_state` (masters and AdamW state by name, whole), which
    under ZeRO every dp rank must gather together before the writer calls this."""
    cfg = trainer.config
    stages = saved_stages(trainer.schedule, trainer.topology.pp_rank)
    masters, opt_state = trainer.full_state() if state is None else state
    out: dict[str, Any] = {
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": 0 if release else int(trainer.iteration),
        "release": release,
        "config": cfg.to_dict(),
        "layout": layout_record(cfg, trainer.bounds, stages, trainer.topology.pp_rank,
                                schedule=trainer.schedule, layer_kinds=trainer.spec.kinds(),
                                tp_rank=trainer.topology.tp_rank,
                                shards=tensor_parallel_shards(trainer, stages),
                                ep_rank=getattr(trainer.topology, "ep_rank", 0),
                                experts=expert_names(trainer, stages)),
    }
    for c, s in enumerate(stages):
        out[chunk_key(c, cfg.plan.parallelism.vpp)] = chunk_state(trainer.stages[s], masters)
    if not release:
        saved = {n for s in stages for n, _ in trainer.stages[s].named_parameters()}
        out["optimizer"] = optimizer_record(trainer, saved, opt_state)
        out["opt_param_scheduler"] = scheduler_record(trainer)
        out["loss_scaler"] = trainer.scaler.state_dict()
        out["consumed_samples"] = int(trainer.iteration) * cfg.global_batch
    return out


def model_chunks(contents: Mapping[str, Any], path: str | None = None) -> list[dict[str, torch.Tensor]]:
    """The model state of every chunk of a loaded file, in chunk order."""
    vpp = int(contents["layout"]["vpp"])
    out = []
    for c in range(vpp):
        key = chunk_key(c, vpp)
        if key not in contents:
            raise CheckpointError(f"missing model state {key!r} (layout says vpp={vpp})",
                                  path=path, field=key)
        out.append(contents[key])
    return out


# Of a stored plan's model: fields that are no part of the model trained (its label, the cost
# model's vocabulary padding; hf_config is compared as the config the family builds from).
_NOT_MODEL = ("name", "vocab_divisible_by", "hf_config")
# Of a Hugging Face config.json: keys that do not change the model a step trains.
_NOT_MODEL_HF = ("transformers_version", "_name_or_path", "name_or_path", "architectures",
                 "torch_dtype", "dtype", "use_cache", "bos_token_id", "eos_token_id",
                 "pad_token_id", "_attn_implementation_autoset", "return_dict")
_ABSENT = "<absent>"
# the flat model fields' names in the stored model description
_FLAT_IN_MODEL = {"layers": "model.layers", "hidden": "model.hidden", "heads": "model.heads",
                  "kv_heads": "model.kv_heads", "ffn_hidden": "model.ffn_hidden",
                  "vocab": "model.vocab", "seq_len": "model.seq_length",
                  "tie_embeddings": "model.tied_embeddings"}


def model_description(config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The model a stored config trains, flat: for the built-in GPT ``model.<field>`` of its
    plan's `ModelSpec`; for a Hugging Face family ``model.family`` and ``model.hf_config.<key>``
    of the config.json the family is built from (`config_for`: the spec's shape written in,
    and what the spec does not say: rope theta, norm epsilon, activation...), which is the
    whole model. None for a config written before configs held a plan (its flat model fields
    are all there is)."""
    plan = config.get("plan")
    model = plan.get("model") if isinstance(plan, dict) else None
    if not isinstance(model, dict):
        return None
    from pipesim.plan.model import ModelSpec
    if model.get("family") is None:
        out = {f"model.{k}": v for k, v in model.items() if k not in _NOT_MODEL}
        try:                 # defaults resolved: kv_heads None and kv_heads = heads are one model
            spec = ModelSpec.from_dict(model)
            out.update({"model.kv_heads": spec.num_kv_heads, "model.head_dim": spec.kv_channels,
                        "model.ffn_hidden": spec.ffn, "model.moe_ffn_hidden": spec.moe_ffn,
                        "model.qkv_bias": spec.bias if spec.qkv_bias is None else spec.qkv_bias,
                        "model.max_position": spec.max_position or spec.seq_length})
        except Exception:    # noqa: BLE001  (an odd stored model: compare it as stored)
            pass
        return out
    from ..models.hf_config import config_for
    try:
        built = config_for(ModelSpec.from_dict(model))
    except Exception:              # noqa: BLE001  (an odd stored model: compare it as stored)
        built = {**(model.get("hf_config") or {}), **{k: v for k, v in model.items()
                                                      if k not in _NOT_MODEL}}
    return {"model.family": model["family"],
            **{f"model.hf_config.{k}": v for k, v in built.items() if k not in _NOT_MODEL_HF}}


def _allowed(key: str, allow: Sequence[str]) -> bool:
    """``key`` (``model.hf_config.rope_theta``, ``layers``) is among ``allow``, written whole,
    without ``model.``, or as its last part (``rope_theta``)."""
    return any(a in (key, key.removeprefix("model."), key.rsplit(".", 1)[-1]) for a in allow)


def model_changes(saved: Mapping[str, Any], current: Mapping[str, Any], *,
                  whole: bool = True) -> list[tuple[str, Any, Any]]:
    """(key, the checkpoint's value, this run's) of every difference in the model: the flat
    model fields (`MODEL_FIELDS`), and with ``whole`` the stored model description
    (`model_description`) key by key, when both configs hold one."""
    saved = legacy_flat(saved)
    out = [(name, saved[name], current[name]) for name in MODEL_FIELDS
           if name in saved and name in current and saved[name] != current[name]]
    ours, theirs = model_description(saved), model_description(current)
    if whole and ours is not None and theirs is not None:
        named = {_FLAT_IN_MODEL[name] for name, _, _ in out}
        for key in sorted(set(ours) | set(theirs)):
            a, b = ours.get(key, _ABSENT), theirs.get(key, _ABSENT)
            if a != b and key not in named:
                out.append((key, a, b))
    return out


def check_model(saved: Mapping[str, Any], current: Mapping[str, Any], *,
                allow: Sequence[str] = (), resume: bool = True, path: str | None = None
                ) -> list[str]:
    """Refuse a checkpoint whose model differs from this run's, naming every key that differs
    with both values (CheckpointError), unless each is in ``allow`` (``--allow-model-change``);
    return notes on the others. A resume compares the model whole; a finetune (weights only:
    ``resume`` False) the flat shape fields alone and notes the rest (a new rope theta or top-k
    on purpose is what finetuning is for)."""
    changes = model_changes(saved, current)
    shape = {k for k, _, _ in model_changes(saved, current, whole=False)}
    refused = [(k, a, b) for k, a, b in changes
               if not _allowed(k, allow) and (resume or k in shape)]
    if refused:
        what = "; ".join(f"{k}: the checkpoint was written with {k}={a!r}, this run has "
                         f"{k}={b!r}" for k, a, b in refused)
        keys = ",".join(k for k, _, _ in refused)
        raise CheckpointError(
            f"config mismatch: the checkpoint's model differs from this run's: {what}. Loading it would train "
            "another model than the one saved: restore the model's settings (its config.json, "
            f"the plan or the flags), or pass --allow-model-change {keys} to accept the change",
            path=path, field=refused[0][0])
    return [f"model changed: {k} {a!r} -> {b!r}" for k, a, b in changes]


def check_config(saved: Mapping[str, Any], current: Mapping[str, Any], *, path: str | None = None,
                 allow_model_change: Sequence[str] = (), resume: bool = True) -> list[str]:
    """Raise on a model-defining difference (`check_model`); return notes on the others (for
    the log). ``saved`` may be the flat form of an older pipeexec (`legacy_flat` reads it)."""

    notes = check_model(saved, current, allow=allow_model_change, resume=resume, path=path)
    saved = legacy_flat(saved)
    for name in TRAINING_FIELDS + LAYOUT_FIELDS + ("hf_model",):   # its tensors' names and
        if name in NEWER_FIELDS and name not in saved:            # shapes are checked on load
            continue                    # written before the field existed: its default ran
        if saved.get(name) != current.get(name):
            notes.append(f"{name} {saved.get(name)!r} -> {current.get(name)!r}")
    return notes
