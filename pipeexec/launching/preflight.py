"""Checks of a ``pipeexec train`` command that need the machine or the files, made before any
worker starts (`TrainConfig.validate` checks the config itself): the CPU share asked for, the
data file, and whether a resumed run has anything left to train."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import ConfigError, TrainConfig

_SNIFF = 64 * 1024


def check_cpus_per_rank(cpus_per_rank: float | None, nproc: int,
                        available: float | None = None) -> None:
    """Refuse a CPU quota per rank this process cannot give: more than the CPUs it may use, or
    ranks whose shares together exceed them (they would still compete for cores, the thing the
    quota is for). ``available``: default `cpu_quota.cpu_limit`."""
    if cpus_per_rank is None:
        return
    from .cpu_quota import cpu_limit

    have = cpu_limit() if available is None else available
    if not cpus_per_rank > 0:
        raise ConfigError(f"--cpus-per-rank must be positive, got {cpus_per_rank:g}")
    if cpus_per_rank * nproc > have + 1e-9:
        raise ConfigError(
            f"--cpus-per-rank {cpus_per_rank:g} for {nproc} rank(s) asks for "
            f"{cpus_per_rank * nproc:g} CPUs, but this process may use {have:g} (CPU affinity "
            f"and cgroup quota): at most --cpus-per-rank {have / nproc:g}, so that every rank "
            "has its share to itself")


def data_warning(data: str) -> str | None:
    """Why ``data`` (a path) does not look like a text corpus, or None. Training reads it as
    byte-level tokens either way; a picture or a JSON dump trains, but rarely on purpose."""
    if data == "synthetic":
        return None
    path = Path(data)
    try:
        with open(path, "rb") as f:
            head = f.read(_SNIFF)
    except OSError:
        return None                       # validate() names a missing file
    if b"\0" in head:
        return f"--data {data}: the file holds NUL bytes: binary, not text"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 4:      # not just a character cut at the sniff's end
            return f"--data {data}: not UTF-8 text (byte {exc.start} is {head[exc.start]:#04x})"
    stripped = head.lstrip()
    if path.suffix.lower() == ".json" or stripped[:1] in (b"{", b"["):
        return f"--data {data}: looks like JSON, not prose"
    return None


@dataclass(frozen=True)
class Preflight:
    """What to tell the user before starting: ``warnings`` (go ahead), and ``nothing_to_train``
    (a resumed run already at or past ``--steps``: do not start)."""

    warnings: tuple[str, ...] = ()
    nothing_to_train: str | None = None


def check_train(config: TrainConfig, checkpoint: Any, *, nproc: int,
                cpus_per_rank: float | None) -> Preflight:
    """All machine- and file-level checks of a local or torchrun ``train`` command."""
    check_cpus_per_rank(cpus_per_rank, nproc)
    warnings = []
    w = data_warning(config.data)
    if w:
        warnings.append(w + "; training on its bytes anyway")
    nothing = None
    if checkpoint is not None and checkpoint.load is not None and not checkpoint.finetune:
        from ..checkpoint import CheckpointError, read_tracker
        from ..checkpoint.layout import RELEASE

        from ..checkpoint.layout import tag_dir
        from ..checkpoint.reader import missing_checkpoint

        tag = checkpoint.ckpt_step if checkpoint.ckpt_step is not None else read_tracker(checkpoint.load)
        if not tag_dir(checkpoint.load, tag).is_dir():
            raise CheckpointError(missing_checkpoint(Path(checkpoint.load), tag,
                                                     asked=checkpoint.ckpt_step is not None))
        if tag != RELEASE and int(tag) >= config.steps and not config.forward_only:
            nothing = (f"nothing to train: the checkpoint in {checkpoint.load} is at iteration "
                       f"{tag} and --steps {config.steps} counts iterations in total (like "
                       f"Megatron's --train-iters); pass --steps {int(tag) + config.steps} to "
                       f"train {config.steps} more")
    return Preflight(tuple(warnings), nothing)
