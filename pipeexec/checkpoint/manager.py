"""`CheckpointOptions` (the ``--save/--load`` flags) and `CheckpointManager`, which ties
loading and saving into the training loop.

Semantics follow Megatron-LM: ``--steps`` counts total iterations (a run resumed at iteration
3 with ``--steps 6`` trains 3 more); ``--save-interval N`` saves after every iteration that is
a multiple of N and the run saves once more at its end (unless it just did); ``--keep-last K``
keeps the newest K iteration checkpoints; ``--ckpt-step N`` loads iteration N instead of the
tracker's; ``--release`` makes the end-of-run save a
weights-only ``release`` checkpoint; ``--load`` fails loudly when there is nothing valid to
load (it never silently starts from a random init).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..flag_fields import option
from .load import LoadReport, load_checkpoint
from .save import SaveReport, parse_fault, save_checkpoint

FAULT_ENV = "PIPEEXEC_CHECKPOINT_FAULT"


def _keys(text: object) -> tuple[str, ...]:
    """``--allow-model-change`` read: its comma-separated keys, as a tuple."""
    if text is None or isinstance(text, tuple):
        return text or ()
    return tuple(k.strip() for k in str(text).split(",") if k.strip())


def _env_fault() -> str | None:
    return os.environ.get(FAULT_ENV) or None


@dataclass(frozen=True)
class CheckpointOptions:
    """The checkpointing concern of a run; its flags are generated from these fields
    (`pipeexec.flag_fields`)."""

    save: str | None = option(None, "directory to save checkpoints to", metavar="DIR")
    save_interval: int | None = option(
        None, "save after every N iterations (and at the end of the run)", type=int,
        metavar="N")
    keep_last: int | None = option(None, "keep only the newest K checkpoints", type=int,
                                   metavar="K")
    load: str | None = option(None, "resume from the latest checkpoint in DIR (any pp/vpp/dp "
                              "layout)", metavar="DIR")
    ckpt_step: int | None = option(None, "load iteration N of --load instead of the latest "
                                   "(the tracker's)", type=int, metavar="N")
    finetune: bool = option(False, "load weights only and start at iteration 0",
                            action="store_true")
    no_load_optim: bool = option(False, "do not load optimizer moments and loss scale "
                                 "(iteration and LR position are kept)", action="store_true")
    no_load_rng: bool = option(False, "do not restore the RNG states", action="store_true")
    release: bool = option(False, "make the end-of-run save a weights-only 'release' "
                           "checkpoint", action="store_true")
    override_opt_param_scheduler: bool = option(
        False, "on a resume, follow this run's learning-rate schedule (--lr, --min-lr, "
        "--warmup-steps, --decay-steps, or --steps without it) where it differs from the "
        "checkpoint's; without it such a resume is refused (Megatron's "
        "--override-opt_param-scheduler)", action="store_true")
    allow_model_change: tuple[str, ...] = option(
        (), "on a resume, accept these keys of the model description differing from the "
        "checkpoint's (comma separated, as the refusal names them, e.g. "
        "model.hf_config.rope_theta); without it a resume of another model is refused",
        metavar="KEY[,KEY]", parse=_keys)
    timeout: float = option(600.0, "seconds a rank waits for the others to finish writing a "
                            "checkpoint", flag="--checkpoint-timeout", type=float, metavar="S")
    verify: bool = option(True, "CRC-check every file before loading it", flag=None)
    # test hook (see save.py): "kill|raise:RANK:ITERATION:before-rename|before-tracker"
    fault: str | None = option(_env_fault, "fault injection of the save (tests)", flag=None,
                               factory=True)

    def validate(self) -> "CheckpointOptions":
        """Raise ValueError naming the flag; checked before any process starts."""
        if self.save_interval is not None and (self.save_interval < 1 or self.save is None):
            raise ValueError("--save-interval needs --save and a positive value, got "
                             f"{self.save_interval}")
        if self.keep_last is not None and (self.keep_last < 1 or self.save is None):
            raise ValueError(f"--keep-last needs --save and a value >= 1, got {self.keep_last}")
        if self.release and self.save is None:
            raise ValueError("--release needs --save (the directory to write it to)")
        for flag, value in (("--finetune", self.finetune), ("--no-load-optim", self.no_load_optim),
                            ("--no-load-rng", self.no_load_rng),
                            ("--ckpt-step", self.ckpt_step is not None),
                            ("--allow-model-change", bool(self.allow_model_change)),
                            ("--override-opt-param-scheduler", self.override_opt_param_scheduler)):
            if value and self.load is None:
                raise ValueError(f"{flag} needs --load")
        if self.ckpt_step is not None and self.ckpt_step < 0:
            raise ValueError(f"--ckpt-step must be a non-negative iteration, got {self.ckpt_step}")
        if self.timeout <= 0:
            raise ValueError(f"checkpoint timeout must be positive, got {self.timeout}")
        parse_fault(self.fault)
        return self

    @property
    def active(self) -> bool:
        return self.save is not None or self.load is not None


class CheckpointManager:
    """Load before the loop (`load`), save from the loop's per-step callback (`on_step`) and at
    the end (`finish`). Holds the reports, for the metrics file."""

    def __init__(self, options: CheckpointOptions, log: Callable[[str], None] | None = None) -> None:
        self.options = options.validate()
        self.log = log
        self.saves: list[SaveReport] = []
        self.loaded: LoadReport | None = None
        self._last_saved: int | None = None

    def load(self, trainer) -> LoadReport | None:
        o = self.options
        if o.load is None:
            return None
        _on_board(trainer, 0, load=True)
        self.loaded = load_checkpoint(trainer, o.load, tag=o.ckpt_step, finetune=o.finetune,
                                      load_optim=not o.no_load_optim, load_rng=not o.no_load_rng,
                                      verify=o.verify, log=self.log,
                                      allow_model_change=tuple(o.allow_model_change))
        if o.save is not None and Path(o.save).resolve() == Path(o.load).resolve():
            self._last_saved = self.loaded.iteration     # already on disk
        return self.loaded

    def save(self, trainer, *, release: bool = False) -> SaveReport:
        o = self.options
        _on_board(trainer, int(trainer.iteration))
        report = save_checkpoint(trainer, o.save, release=release, keep_last=o.keep_last,
                                 timeout=o.timeout, sequence=len(self.saves), fault=o.fault,
                                 log=self.log)
        self.saves.append(report)
        if not release:
            self._last_saved = int(trainer.iteration)
        return report

    def on_step(self, trainer, stats=None) -> None:
        o = self.options
        if o.save is not None and o.save_interval and trainer.iteration % o.save_interval == 0:
            self.save(trainer)

    def finish(self, trainer) -> None:
        o = self.options
        if o.save is None:
            return
        if o.release:
            self.save(trainer, release=True)
        elif self._last_saved != trainer.iteration:
            self.save(trainer)

    def metrics(self) -> dict:
        return {"save_times": [r.seconds for r in self.saves],
                "save_write_times": [r.write_seconds for r in self.saves],
                "save_bytes": [r.bytes for r in self.saves],
                "load_time": None if self.loaded is None else self.loaded.seconds,
                "loaded_iteration": None if self.loaded is None else self.loaded.iteration,
                "resharded": None if self.loaded is None else self.loaded.resharded}


def _on_board(trainer, iteration: int, *, load: bool = False) -> None:
    """Tell the local launcher's board (when there is one) that this rank is in a checkpoint
    save or load, so that a worker killed there is reported in it."""
    board = getattr(trainer, "board", None)
    if board is not None:
        board.set_checkpoint(trainer.topology.rank, iteration, load=load)
