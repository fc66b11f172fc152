"""What a calibration run was: the fields its per-action costs depend on, and matching a new
run against them.

A measured run's ``.meta.json`` holds the whole run description: its config (model shape,
micro-batch size, precision, ...), the CPU share each rank had (``cpus_per_rank``, the
``--cpus-per-rank`` quota, or None when the ranks were not confined; ``rank_cpus``: what each
could use) and its hosts. Calibrated costs are per (op, stage) seconds and bytes of *that*
model on *those* CPUs: re-partitioning carries them to another pp / vpp / schedule / partition
/ microbatch count, but nothing rescales them to a wider layer, a longer sequence, another
precision or another CPU share. So ``pipeexec compare --calibrate-from`` takes every such field
from the calibration run unless the user set it, and refuses a run that differs, naming each
field with both values (`inherit`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

from pipesim.plan.model import ModelSpec

from ..config import MODEL_VIEWS, ConfigError, TrainConfig, legacy_flat

# Config fields the per-action costs (time and activation bytes) depend on.
COST_FIELDS = ("hf_model", "layers", "hidden", "heads", "kv_heads", "seq_len", "vocab", "ffn_hidden",
               "micro_batch_size", "precision", "cpu_keep_freed_memory", "deallocate_outputs",
               "recompute", "recompute_layers")
# Of those, the model's shape (given any of them, the calibration run's model is not taken whole).
SHAPE_FIELDS = ("layers", "hidden", "heads", "kv_heads", "seq_len", "vocab", "ffn_hidden", "model")
# The one that is not a config field: each rank's CPU quota of a local run.
CPU_SHARE = "cpus_per_rank"


def flag(name: str) -> str:
    """The command-line flag that sets a config field (the config's own metadata)."""
    return TrainConfig.flag(name)


def _shown(name: str, value: Any) -> str:
    if name == "cpu_keep_freed_memory":
        return "off" if value else "on"            # the flag's sense: return freed memory
    if name == CPU_SHARE:
        return "not confined" if value is None else f"{value:g}"
    return str(value)


def cpu_share(meta: dict[str, Any]) -> float | None:
    """The CPU quota each rank of a measured run had (``--cpus-per-rank``), None when not
    confined. Runs recorded before ``cpus_per_rank`` was: from ``rank_cpus`` (a rank confined
    below one CPU could use that fraction)."""
    if CPU_SHARE in meta:
        value = meta[CPU_SHARE]
        return None if value is None else float(value)
    cpus = meta.get("rank_cpus") or []
    return float(max(cpus)) if cpus and max(cpus) < 1.0 else None


@dataclass(frozen=True)
class Inherited:
    """The run to compare, after taking the calibration run's fields: the config, the CPU
    share, the fields taken (field -> value) and notes (what differs but is not refused)."""

    config: TrainConfig
    cpus_per_rank: float | None
    taken: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        """``layers 6, hidden 256, ...`` for the log ('' when nothing was taken)."""
        return ", ".join(f"{flag(k).lstrip('-').split(' ')[0]} {_shown(k, v)}"
                         for k, v in self.taken.items())


def inherit(config: TrainConfig, given: set[str], meta: dict[str, Any], *,
            cpus_per_rank: float | None, source: str) -> Inherited:
    """Take every cost field the user did not set (``given``: config field names, and
    ``cpus_per_rank`` when ``--cpus-per-rank`` was passed) from the calibration run's
    ``meta``; raise ConfigError naming every field set to another value than the calibration
    run's, with both values."""
    recorded = meta.get("config")
    if not isinstance(recorded, dict):
        raise ConfigError(f"calibration run {source} does not record its run description "
                          "(no 'config' in its .meta.json: written by an older pipeexec?); "
                          "profile the calibration run again")
    recorded = legacy_flat(recorded)
    changes: dict[str, Any] = {}
    taken: dict[str, Any] = {}
    differ: list[str] = []
    plan = recorded.get("plan")
    if isinstance(plan, dict) and isinstance(plan.get("model"), dict) and not (
            given & set(SHAPE_FIELDS)):
        # the run's whole model (a Hugging Face family's too), not only its shape's numbers
        theirs = ModelSpec.from_dict(plan["model"], f"calibration run {source}: model")
        if (theirs, theirs.family) != (config.model, config.model.family):
            before = config
            config = config.replace(plan=replace(config.plan, model=theirs))
            # the fields that differ as given (a kv_heads or ffn_hidden left to its default
            # follows heads or hidden, and is not named)
            flat = config.to_flat()
            taken.update({k: flat[k] for k in SHAPE_FIELDS[:-1]
                          if getattr(theirs, MODEL_VIEWS[k]) != getattr(before.model,
                                                                      MODEL_VIEWS[k])})
            if theirs.family != before.model.family:
                taken["model"] = theirs.family or theirs.name
    flat = config.to_flat()          # the recorded form's names
    for name in COST_FIELDS:
        if name not in recorded:
            continue
        theirs, ours = recorded[name], flat[name]
        if name in given or (name == "cpu_keep_freed_memory" and "cpu_return_freed_memory" in given):
            if ours != theirs:
                differ.append(f"{flag(name)} {_shown(name, ours)} (calibration run: "
                              f"{_shown(name, theirs)})")
        elif ours != theirs:
            changes[name] = theirs
            taken[name] = theirs
    share = cpu_share(meta)
    if CPU_SHARE in given:
        if cpus_per_rank != share:
            differ.append(f"--cpus-per-rank {_shown(CPU_SHARE, cpus_per_rank)} (calibration "
                          f"run: {_shown(CPU_SHARE, share)})")
    else:
        if cpus_per_rank != share:
            taken[CPU_SHARE] = share
        cpus_per_rank = share
    if differ:
        raise ConfigError(
            f"this run differs from the calibration run {source} in {len(differ)} field(s) its "
            f"costs depend on: {'; '.join(differ)}. Calibrated costs are that model's seconds "
            "and bytes on that CPU share; drop these flags to take them from the calibration "
            "run, or calibrate from a run made with them")
    notes = []
    host_cpus = meta.get("host_cpus")
    here = os.cpu_count()
    if host_cpus and here and int(host_cpus) != here:
        notes.append(f"the calibration run's host had {host_cpus} CPUs, this one has {here}: "
                     "costs measured on another machine")
    weights = changes.pop("hf_model", None)
    config = config.with_flat(**changes)
    if weights:                 # an older run's Hugging Face directory: its model, as then
        config = config.with_hf_model(weights)
    return Inherited(config, cpus_per_rank, taken, tuple(notes))
