"""``pipeexec checkpoint convert``: rewrite a checkpoint for another (pp, vpp, dp, schedule);
tensor- and expert-parallel shards are put together (tp 1, ep 1: whole tensors).

A run can load a checkpoint of any layout directly (`load.load_checkpoint` picks entries by
global name); converting ahead of time gives each new rank a single file of its own, and is
the tool for inspecting or shipping a resharded checkpoint. Since every entry is keyed by
global layer index and parameter name, conversion is regrouping: no tensor changes.

The new layout's stage bounds come from the saved config's partition method (or new explicit
boundaries); "params" balancing uses parameter counts measured from the checkpoint's own
tensors, so it needs no model code. The global batch should stay the same (dp x microbatches x
micro batch size) for the continued run to see the batches the original would have.
"""
from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError, TrainConfig, legacy_flat
from ..partition import make_partition, plan_bounds
from .atomic import atomic_write, remove_stale_temps
from .contents import layout_record, layer_of, model_chunks, saved_stages, stage_layer_range
from .errors import CheckpointError
from .layout import Tag, chunk_key, state_file, tag_dir_name, tracker_path
from .reader import CheckpointReader
from .tracker import write_tracker


@dataclass
class ConvertReport:
    tag: Tag
    seconds: float
    source_layout: dict
    target_layout: dict
    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def config_from_dict(saved: dict[str, Any], *, path: str | None = None) -> tuple[TrainConfig, list[str]]:
    """A `TrainConfig` from a checkpoint's config dict (today's, with its plan, or an older
    pipeexec's flat one); unknown fields are dropped (noted)."""
    known = set(TrainConfig.field_names()) | {"plan"}
    values = {k: v for k, v in legacy_flat(saved).items() if k in known}
    dropped = sorted(set(legacy_flat(saved)) - known)
    try:
        config = TrainConfig.from_dict(values)
    except (TypeError, ConfigError) as e:
        raise CheckpointError(f"unusable config in the checkpoint ({e})", path=path,
                              field="config") from e
    return config, [f"dropped unknown config fields {dropped}"] if dropped else []


def convert_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, *, tag: Tag | None = None,
                       pp: int | None = None, vpp: int | None = None, dp: int | None = None,
                       schedule: str | None = None, microbatches: int | None = None,
                       partition: str | None = None, boundaries: tuple[int, ...] | None = None,
                       log: Callable[[str], None] | None = None) -> ConvertReport:
    """Write checkpoint ``tag`` of ``src`` (default: the tracker's) into ``dst`` in a new layout."""
    t0 = time.perf_counter()
    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise CheckpointError("convert writes a new directory; source and destination are the same",
                              path=dst)
    if tracker_path(dst).exists():
        raise CheckpointError("destination already holds a checkpoint (tracker present); choose "
                              "an empty directory", path=tracker_path(dst))
    reader = CheckpointReader(src, tag)
    old_cfg, notes = config_from_dict(reader.config, path=str(reader.path(0)))
    changes = {k: v for k, v in dict(pp=pp, vpp=vpp, dp=dp, schedule=schedule,
                                     microbatches=microbatches, partition=partition).items()
               if v is not None}
    if boundaries is not None or "pp" in changes or "vpp" in changes:
        changes["boundaries"] = tuple(boundaries) if boundaries is not None else None
    if reader.tp > 1:       # the shards put together: whole tensors, which any tp cuts on load
        changes.update(tp=1, sequence_parallel=False)
        notes.append(f"tensor-parallel shards of tp {reader.tp} put together: the converted "
                     "checkpoint holds whole tensors (tp 1), which a run at any tp cuts on load")
    if reader.ep > 1:       # every ep rank's experts put together: whole expert tensors
        changes.update(ep=1)
        notes.append(f"expert-parallel shards of ep {reader.ep} put together: the converted "
                     "checkpoint holds every expert in each tensor (ep 1), which a run at any "
                     "ep cuts on load")
    new_cfg = old_cfg.with_flat(**changes)       # the command's flags, by their names
    num_layers = int(reader.layout["num_layers"])
    new_cfg.validate(num_layers=num_layers)
    if new_cfg.global_batch != old_cfg.global_batch:
        notes.append(f"global batch {old_cfg.global_batch} -> {new_cfg.global_batch}")

    # Every entry of the source, by global name.
    model: dict[str, torch.Tensor] = {}
    opt_state: dict[str, dict] = {}
    param_names: list[str] = []
    for r in range(reader.pp):
        f = reader.file(r)
        for c, chunk in enumerate(model_chunks(f, str(reader.path(r)))):
            for key in chunk:
                model[key] = reader.whole(r, key, lambda g, c=c, key=key: model_chunks(g)[c][key])
        if not reader.release:
            for n, st in f["optimizer"]["state"].items():
                opt_state[n] = {k: (reader.whole(r, n, lambda g, n=n, k=k:
                                                 g["optimizer"]["state"][n][k])
                                    if torch.is_tensor(v) and v.dim() > 0 else v)
                                for k, v in st.items()}
            param_names.extend(f["optimizer"]["param_names"])
    layers_present = sorted({layer_of(n) for n in model})
    if layers_present != list(range(num_layers)):
        raise CheckpointError(f"the checkpoint's model state covers layers {layers_present}, "
                              f"expected 0..{num_layers - 1}", path=reader.dir, field="model")
    counts = [0] * num_layers
    for n, t in model.items():
        counts[layer_of(n)] += t.numel()
    kinds = reader.layout.get("layer_kinds") or []
    if (new_cfg.layout.partition == "layers" and new_cfg.layout.boundaries is None
            and num_layers == new_cfg.num_layers and kinds[:1] == ["embedding"]
            and kinds[-1:] == ["head"]):
        bounds = plan_bounds(new_cfg.plan)        # the plan's model: cut as the Trainer cuts it
    else:
        bounds = make_partition(num_layers, new_cfg.num_stages, new_cfg.layout.partition,
                                new_cfg.layout.boundaries, counts)
    sched = new_cfg.build_schedule()
    first = reader.file(0)
    report = ConvertReport(reader.tag, 0.0, dict(reader.layout, pp_rank=None), {})
    save_id = uuid.uuid4().hex
    known = set(param_names)
    for r in range(new_cfg.plan.parallelism.pp):
        stages = saved_stages(sched, r)             # copies of a part are saved once
        out: dict[str, Any] = {k: first[k] for k in ("checkpoint_version", "iteration", "release")}
        out["save_id"] = save_id
        out["config"] = new_cfg.to_dict()
        out["layout"] = layout_record(new_cfg, bounds, stages, r, schedule=sched,
                                      layer_kinds=reader.layout.get("layer_kinds"))
        names_here: list[str] = []
        for c, s in enumerate(stages):
            layers = stage_layer_range(sched, bounds, s)
            # Keep the source's order within a layer (parameters as the module lists them).
            chunk = {n: t.clone() for n, t in model.items() if layer_of(n) in layers}
            chunk = dict(sorted(chunk.items(), key=lambda kv: layer_of(kv[0])))
            out[chunk_key(c, new_cfg.plan.parallelism.vpp)] = chunk
            names_here.extend(n for n in chunk if n in known)
        if not reader.release:
            out["optimizer"] = {
                "state": {n: opt_state[n] for n in names_here if n in opt_state},
                "param_names": names_here,
                "param_groups": first["optimizer"]["param_groups"],
            }
            for k in ("opt_param_scheduler", "loss_scaler", "consumed_samples"):
                out[k] = first[k]
            src_rng = reader.file(min(r, reader.pp - 1))["rng_state"]
            out["rng_state"] = [src_rng[d if d < len(src_rng) else 0]
                                for d in range(new_cfg.plan.parallelism.dp)]
        path = state_file(dst, reader.tag, r)
        remove_stale_temps(path.parent)
        atomic_write(path, lambda fh, out=out: torch.save(out, fh))
        report.files.append(str(path))
    report.target_layout = layout_record(new_cfg, bounds, [], 0) | {"pp_rank": None, "stages": None,
                                                                      "layers": None}
    write_tracker(dst, reader.tag)
    report.seconds = time.perf_counter() - t0
    report.notes = notes
    if log is not None:
        lay = reader.layout
        par = new_cfg.plan.parallelism
        log(f"checkpoint: converted {tag_dir_name(reader.tag)} from pp={lay['pp']} vpp={lay['vpp']} "
            f"dp={lay['dp']} {lay['schedule']} (bounds {lay['bounds']}) to pp={par.pp} "
            f"vpp={par.vpp} dp={par.dp} {new_cfg.plan.schedule_name} (bounds {list(bounds)}) in "
            f"{report.seconds:.3f} s: {dst}" + (f"; notes: {'; '.join(notes)}" if notes else ""))
    return report
