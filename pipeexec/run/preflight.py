"""Checks of a ``pipeexec train`` command that need the machine or the files, made before any
worker starts (`TrainConfig.validate` checks the config itself): the CPU share asked for, the
data file, the tokenizer's vocabulary, the run's time limit, whether a checkpoint to load was
written by the same model, whether a resumed run has anything left to train and whether it
keeps the checkpoint's learning-rate schedule."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..config import ConfigError, TrainConfig
from ..launching.cpu_quota import cpu_limit
from ..checkpoint import CheckpointError, read_tracker
from ..checkpoint.contents import check_model
from ..checkpoint.layout import RELEASE, tag_dir
from ..checkpoint.reader import CheckpointReader, missing_checkpoint

_SNIFF = 64 * 1024


def check_cpus_per_rank(cpus_per_rank: float | None, nproc: int,
                        available: float | None = None) -> None:
    """Refuse a CPU quota per rank this process cannot give: more than the CPUs it may use, or
    ranks whose shares together exceed them (they would still compete for cores, the thing the
    quota is for). ``available``: default `cpu_quota.cpu_limit`."""
    if cpus_per_rank is None:
        return

    have = cpu_limit() if available is None else available
    if not cpus_per_rank > 0:
        raise ConfigError(f"--cpus-per-rank must be positive, got {cpus_per_rank:g}")
    if cpus_per_rank * nproc > have + 1e-9:
        raise ConfigError(
            f"--cpus-per-rank {cpus_per_rank:g} for {nproc} rank(s) asks for "
            f"{cpus_per_rank * nproc:g} CPUs, but this process may use {have:g} (CPU affinity "
            f"and cgroup quota): at most --cpus-per-rank {have / nproc:g}, so that every rank "
            "has its share to itself")


def check_timeout(timeout: float | None) -> None:
    """Refuse a ``--timeout`` that means nothing: nan (no limit at all), inf, or not above
    zero (the run would start, then time out at once)."""
    if timeout is None:
        return
    if not (math.isfinite(timeout) and timeout > 0):
        raise ConfigError(f"--timeout must be a finite number of seconds > 0 (the whole local "
                          f"run's limit; leave it out for none), got {timeout:g}")


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


def check_tokenizer(config: TrainConfig) -> None:
    """Refuse a ``--tokenizer`` that does not load, or whose vocabulary exceeds the model's."""
    if config.inputs.tokenizer is None:
        return
    from ..datasets.tokenizer import TokenizerError, check_vocab, load_tokenizer

    try:
        check_vocab(load_tokenizer(config.inputs.tokenizer), config.plan.model.vocab)
    except TokenizerError as exc:
        raise ConfigError(str(exc)) from None


def token_dtype_warning(config: TrainConfig) -> str | None:
    """Why ``--data-path``'s corpora look tokenized for a larger vocabulary than the model's,
    or None: preprocessing stores ids as int32 only for a vocabulary of 65,500 ids or more
    (Megatron's ``DType.optimal_dtype``). O(1): the ids themselves are checked batch by batch."""
    if not config.inputs.data_path or config.plan.model.vocab >= 65500:
        return None
    import numpy as np

    from ..datasets.blend import BlendError, parse_data_path
    from ..datasets.indexed import IndexedDatasetError, idx_path, read_header

    try:
        prefixes, _ = parse_data_path(config.inputs.data_path)
        wide = [p for p in prefixes if np.dtype(read_header(idx_path(p)).dtype).itemsize > 2]
    except (BlendError, IndexedDatasetError, OSError):
        return None                       # validate() names what is wrong
    if not wide:
        return None
    return (f"--data-path {', '.join(wide)}: tokens stored as 32-bit ids, as preprocessing "
            f"writes them for a vocabulary of 65,500 ids or more, but --vocab is "
            f"{config.plan.model.vocab}: an id past it stops the run at its batch")


def microbatch_warning(pp: int, microbatches: int) -> str | None:
    """Why a pipeline of fewer microbatches than stages wastes most of its ranks, or None."""
    if microbatches >= pp:
        return None
    idle = 1 - microbatches / (microbatches + pp - 1)
    return (f"--microbatches {microbatches} with --pp {pp}: a pipeline of m = {microbatches} "
            f"keeps each rank idle about {idle:.0%} of the step (bubble (p-1)/(m+p-1)); pass "
            f"--microbatches {pp} or more (4 x pp keeps the bubble small)")


def cp_comm_warning(par: Any) -> str | None:
    """Why a plan's context-parallel exchange is not the one pipeexec runs, or None: pipeexec
    all-gathers K/V (`pipeexec.parallel.context`), so a plan priced with the ring
    (``cp_comm = "p2p"``, pipesim's default for GPU planning) predicts another run."""
    if par.cp == 1 or par.cp_comm == "all_gather":
        return None
    return (f"parallelism.cp_comm = {par.cp_comm!r}: the plan prices context parallelism's "
            "K/V exchange as a ring, pipeexec all-gathers K/V and recomputes the attention in "
            "the backward; running it so (plan with `pipesim plan --cp-comm all_gather` for a "
            "prediction of this run)")


def tp_comm_overlap_warning(par: Any) -> str | None:
    """Why a plan's tensor-parallel overlap is not what pipeexec runs, or None: the plan
    prices Megatron's --tp-comm-overlap (userbuffers), pipeexec runs the collectives exposed."""
    if par.tp == 1 or not par.overlap_tp_comm:
        return None
    return ("parallelism.overlap_tp_comm: the plan prices the tensor-parallel collectives "
            "hidden under their GEMMs (Megatron's --tp-comm-overlap), pipeexec runs them "
            "exposed; running it so (plan with --no-tp-comm-overlap for a prediction of this "
            "run)")


@dataclass(frozen=True)
class Preflight:
    """What to tell the user before starting: ``warnings`` (go ahead), and ``nothing_to_train``
    (a resumed run already at or past ``--steps``: do not start)."""

    warnings: tuple[str, ...] = ()
    nothing_to_train: str | None = None


def check_train(config: TrainConfig, checkpoint: Any, *, nproc: int,
                cpus_per_rank: float | None, timeout: float | None = None) -> Preflight:
    """All machine- and file-level checks of a local or torchrun ``train`` command."""
    check_cpus_per_rank(cpus_per_rank, nproc)
    check_timeout(timeout)
    check_tokenizer(config)
    warnings = []
    w = data_warning(config.inputs.data)
    if w:
        warnings.append(w + ("; training on its bytes anyway" if config.inputs.tokenizer is None
                             else "; tokenizing it anyway"))
    par = config.plan.parallelism
    for w in (token_dtype_warning(config), microbatch_warning(par.pp, config.plan.microbatches),
              cp_comm_warning(par), tp_comm_overlap_warning(par)):
        if w:
            warnings.append(w)
    nothing = None
    if checkpoint is not None and checkpoint.load is not None:
        tag = checkpoint.ckpt_step if checkpoint.ckpt_step is not None else read_tracker(checkpoint.load)
        if not tag_dir(checkpoint.load, tag).is_dir():
            raise CheckpointError(missing_checkpoint(Path(checkpoint.load), tag,
                                                     asked=checkpoint.ckpt_step is not None))
    if checkpoint is not None and checkpoint.load is not None and not checkpoint.finetune:
        steps = config.optimizer.steps
        if tag != RELEASE and int(tag) >= steps and not config.runtime.forward_only:
            nothing = (f"nothing to train: the checkpoint in {checkpoint.load} is at iteration "
                       f"{tag} and --steps {steps} counts iterations in total (like "
                       f"Megatron's --train-iters); pass --steps {int(tag) + steps} to "
                       f"train {steps} more")
        elif tag != RELEASE:
            try:
                reader = CheckpointReader(checkpoint.load, tag, verify=False)
                first, where = reader.file(0), str(reader.path(0))
            except CheckpointError:
                first, where = {}, None   # the workers' load names what is wrong with the files
            if isinstance(first.get("config"), dict):     # another model: refused here, first
                check_model(first["config"], config.to_dict(), path=where,
                            allow=tuple(getattr(checkpoint, "allow_model_change", ()) or ()))
            if not (checkpoint.override_opt_param_scheduler or config.runtime.forward_only):
                check_lr_schedule(config, first.get("opt_param_scheduler"), checkpoint.load)
            w = data_change_warning(config, first.get("config"))
            if w:
                warnings.append(f"--load {checkpoint.load}: {w}")
    return Preflight(tuple(warnings), nothing)


# what, besides the files, fixes the sample of each step
_DATA_FIELDS = ("data", "data_path", "split", "seed", "seq_len", "tokenizer")


def data_change_warning(config: TrainConfig, saved: dict | None) -> str | None:
    """Why a resumed run will not train the samples the checkpoint's run would have trained
    next, or None: a data setting changed, or (``--data-path``) a planned length that changes
    the epoch count, hence the shuffle (`pipeexec.datasets.build.train_order`)."""
    if not isinstance(saved, dict):
        return None
    changed = []
    ours_flat, default = config.to_flat(), TrainConfig().to_flat()   # the saved form's names
    for name in _DATA_FIELDS:
        ours = ours_flat[name]
        theirs = saved.get(name, default[name])
        if name == "data_path":
            theirs = tuple(theirs or ())
        if name == "tokenizer" and config.inputs.data == "synthetic":
            continue
        if ours != theirs:
            changed.append(f"{TrainConfig.flag(name)} {theirs!r} -> {ours!r}")
    if changed:
        return ("the data differs from the checkpoint's run (" + "; ".join(changed)
                + "): the steps after it draw other samples than that run would have")
    if not config.inputs.data_path:
        return None
    from ..datasets import DataPathError
    from ..datasets.build import train_order

    try:
        optimizer = replace(config.optimizer,
                            steps=int(saved.get("steps", config.optimizer.steps)),
                            decay_steps=saved.get("decay_steps"))
        before = train_order(config.replace(optimizer=optimizer))
        now = train_order(config)
    except (DataPathError, ConfigError, TypeError, ValueError):
        return None
    if before != now:
        return ("--steps / --decay-steps change the train samples asked for, and with them the "
                "number of epochs, hence the shuffle of the whole train split (Megatron's "
                "--train-iters does the same): the steps after it draw other samples; keep "
                "max(--steps, --decay-steps) as it was to continue the same order")
    return None


# the checkpoint's scheduler record key -> (the run's value, the flag that sets it)
_SCHEDULE = {"max_lr": ("lr", "--lr"), "min_lr": ("min_lr", "--min-lr"),
             "warmup_steps": ("warmup_steps", "--warmup-steps"),
             "decay_steps": ("decay_steps", "--decay-steps")}


def check_lr_schedule(config: TrainConfig, record: dict | None, load: str) -> None:
    """Refuse a resume whose learning-rate schedule differs from the checkpoint's (a different
    ``--steps`` moves the cosine decay's end: the LR jumps), naming both values and the two ways
    on: the flags that keep the checkpoint's schedule, or ``--override-opt-param-scheduler``.
    ``record``: the checkpoint's ``opt_param_scheduler`` (None: an old checkpoint, not checked)."""
    if not record:
        return
    opt = config.optimizer
    run = {"max_lr": opt.lr, "min_lr": opt.min_lr, "warmup_steps": opt.warmup_steps,
           "decay_steps": opt.decay_steps or opt.steps}
    differ = [k for k in _SCHEDULE if k in record and not _same(record[k], run[k])]
    if not differ:
        return
    what = []
    for k in differ:
        field, flag = _SCHEDULE[k]
        yours = (f"{flag} {run[k]:g}" if k != "decay_steps" or opt.decay_steps else
                 f"--steps {opt.steps} (the decay ends at --steps unless --decay-steps is "
                 "given)")
        what.append(f"{k} {record[k]:g} in the checkpoint, {run[k]:g} in this run ({yours})")
    keep = " ".join(f"{_SCHEDULE[k][1]} {record[k]:g}" for k in differ)
    raise ConfigError(
        f"--load {load}: the checkpoint's learning-rate schedule differs from this run's: "
        + "; ".join(what) + f". Resuming would reshape the schedule mid-run. Pass {keep} to keep "
        "the checkpoint's schedule, or --override-opt-param-scheduler to follow this run's")


def _same(a: float, b: float) -> bool:
    return abs(float(a) - float(b)) <= 1e-12 * max(1.0, abs(float(a)), abs(float(b)))
