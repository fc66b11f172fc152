"""``pipeexec checkpoint inspect DIR``: what a checkpoint directory holds, in plain text.

Lists the saved iterations (and which are complete: every rank file present and readable),
then for the tracker's checkpoint (or ``--iteration``): version, iteration, data position,
layout, the config fields that define the model, and per rank file its size, chunks, layers,
parameter count, optimizer entries, LR position, loss scale and RNG states.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..config import legacy_flat
from .contents import LAYOUT_FIELDS, MODEL_FIELDS, model_chunks
from .errors import CheckpointError
from .layout import RELEASE, Tag, every_rank_file, saved_iterations, tag_dir, tracker_path
from .reader import CheckpointReader
from .tracker import read_tracker


def _status(root: Path, tag: Tag) -> str:
    try:
        reader = CheckpointReader(root, tag, verify=False)
        return f"{reader.pp} rank file(s)"
    except CheckpointError as e:
        return f"INCOMPLETE ({e})"


def describe(root: str | os.PathLike, tag: Tag | None = None, *, verify: bool = True) -> str:
    """A human-readable report of checkpoint directory ``root`` (raises CheckpointError)."""
    root = Path(root)
    lines = [f"checkpoint directory {root}"]
    latest = read_tracker(root)
    lines.append(f"  tracker {tracker_path(root).name}: {latest}")
    tags: list[Tag] = list(saved_iterations(root))
    if tag_dir(root, RELEASE).is_dir():
        tags.append(RELEASE)
    for t in tags:
        mark = "  <- latest" if t == latest else ""
        lines.append(f"  {tag_dir(root, t).name}: {_status(root, t)}{mark}")
    tag = latest if tag is None else tag
    reader = CheckpointReader(root, tag, verify=verify)
    lay, cfg = reader.layout, legacy_flat(reader.config)     # an older pipeexec's flat form too
    family = ((cfg.get("plan") or {}).get("model") or {}).get("family")
    first = reader.file(0)
    lines.append(f"{tag_dir(root, tag).name}: checkpoint_version {first['checkpoint_version']}, "
                 f"iteration {reader.iteration}" + (", release (weights only)" if reader.release
                                                    else f", consumed_samples {first['consumed_samples']}"))
    lines.append("  model: " + ("" if family is None else f"{family} (Hugging Face), ")
                 + ", ".join(f"{k}={cfg.get(k)}" for k in MODEL_FIELDS))
    lines.append("  layout: " + ", ".join(f"{k}={cfg.get(k)}" for k in LAYOUT_FIELDS)
                 + f", stage bounds {lay['bounds']}")
    lines.append(f"  training: precision={cfg.get('precision')} seed={cfg.get('seed')} "
                 f"steps={cfg.get('steps')} lr={cfg.get('lr')} data={cfg.get('data')}")
    if not reader.release:
        sch, sc = first["opt_param_scheduler"], first["loss_scaler"]
        lines.append(f"  opt_param_scheduler: num_updates {sch['num_updates']} (max_lr "
                     f"{sch['max_lr']}, min_lr {sch['min_lr']}, warmup {sch['warmup_steps']}, decay "
                     f"{sch['decay_steps']}); loss_scaler: scale {sc['scale']:g}, good steps "
                     f"{sc['good_steps']}{' (dynamic)' if sc.get('dynamic') else ''}")
    total = 0
    # tp rank t's shards of pp rank r (and, under ep, ep rank e's experts)
    for (t, r, e), path in every_rank_file(root, tag).items():
        f = reader.expert_file(r, t, e or 0)
        chunks = model_chunks(f, str(path))
        params = sum(t.numel() for ch in chunks for t in ch.values())
        total += params
        parts = []
        for c, (stage, layers) in enumerate(zip(f["layout"]["stages"], f["layout"]["layers"])):
            parts.append(f"chunk {c}: stage {stage}, layers {layers[0]}..{layers[-1]}, "
                         f"{len(chunks[c])} tensors")
        lines.append(f"  {path.relative_to(root)}: {path.stat().st_size / 2 ** 20:.2f} MiB, "
                     f"{params:,} model values; " + "; ".join(parts))
        if not reader.release:
            lines.append(f"    optimizer: AdamW state for {len(f['optimizer']['state'])} of "
                         f"{len(f['optimizer']['param_names'])} parameters; rng_state for "
                         f"{len(f['rng_state'])} data-parallel replica(s)")
    lines.append(f"  total: {total:,} model values in the files" + (" (files verified: CRC-32 of every record)"
                                                      if verify else ""))
    return "\n".join(lines)
