"""Validation: a loss on held-out data, run through the schedule's forward-only variant.

``--eval-interval N --eval-iters K`` (Megatron-LM's names): after every N-th iteration (and
once at the end of the run, unless it just evaluated) the run computes the mean loss of K
validation global batches, each cut into the run's microbatches and replicas as a training
batch is, through the forward-only schedule of the run's layout (pp, vpp, tp, dp, cp, ep,
ZeRO). ``--eval-only`` evaluates once (the loaded checkpoint's weights with ``--load``) and
trains nothing. Every evaluation reads the same K batches, so successive validation losses
compare the same data.

What "validation data" is, per data source (`valid_batches`, the one interface a data source
plugs into; an indexed dataset's validation split plugs in here by returning its own
`ValidationData`):

* ``--data synthetic``: the same generator as training, on a stream of its own: validation
  batch ``i`` is the synthetic batch of step ``-1 - i``, which no training step reads (training
  steps are ``0, 1, ...``); the held-out sequences follow the training sequences' rule (a
  rule with few distinct sequences at a small vocabulary: the stream's draws are new, its
  sequences may not be, so the loss measures how well the rule is learnt).
* ``--data FILE`` (byte text): a held-out text file, ``--valid-data FILE``, read as the
  training file is (random windows, vocabulary 256). Without one, validation of a text run is
  refused before any process starts: windows of the training file are training data.
* ``--data-path``: the validation split of the indexed datasets (``--split``'s second share,
  `pipeexec.datasets`), built for ``eval_iters`` global batches, as Megatron's validation
  dataset is; validation batch ``i`` is its samples ``i * global_batch ..``. A split that leaves
  validation empty is refused before any process starts.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..config import ConfigError, TrainConfig
from ..data import BatchSource
from ..flag_fields import option


@dataclass(frozen=True)
class EvalOptions:
    """The validation concern of a run; its flags are generated from these fields."""

    eval_interval: int | None = option(
        None, "compute the validation loss after every N iterations (and at the end of the "
        "run), through the forward-only schedule of the run's layout", type=int, metavar="N")
    eval_iters: int = option(1, "validation global batches per evaluation (the same ones at "
                             "every evaluation)", type=int, metavar="K")
    eval_only: bool = option(False, "evaluate once (with --load: the checkpoint's weights) and "
                             "train nothing (nor save)", action="store_true")
    valid_data: str | None = option(
        None, "held-out text file for validation when --data is a text file (byte-level "
        "tokens, read as --data is); synthetic data validates on a stream of its own",
        metavar="FILE")

    @property
    def active(self) -> bool:
        return self.eval_interval is not None or self.eval_only

    def validate(self, config: TrainConfig) -> "EvalOptions":
        """Raise ConfigError naming the flag; checked before any process starts."""
        for flag, value in (("--eval-interval", self.eval_interval),
                            ("--eval-iters", self.eval_iters)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ConfigError(f"{flag} must be a positive integer, got {value!r}")
        if not isinstance(self.eval_only, bool):
            raise ConfigError(f"eval_only must be true or false, got {self.eval_only!r}")
        if self.valid_data is not None and not self.active:
            raise ConfigError("--valid-data is read by validation: give --eval-interval N (or "
                              "--eval-only) with it")
        if not self.active:
            return self
        if config.runtime.forward_only:
            raise ConfigError("--forward-only evaluates the training batches; validation "
                              "(--eval-interval, --eval-only) runs its own forward-only "
                              "schedule: drop --forward-only")
        if config.inputs.data_path:
            flag = "--eval-only" if self.eval_interval is None else "--eval-interval"
            if self.valid_data is not None:
                raise ConfigError(f"--valid-data {self.valid_data}: --data-path validates on "
                                  "its own validation split (--split); drop --valid-data")
            from ..datasets import DataPathError, check_split_for_eval

            try:
                check_split_for_eval(config.inputs.data_path, config.inputs.split,
                                     config.plan.model.seq_length, flag)
            except DataPathError as exc:
                raise ConfigError(str(exc)) from None
            return self
        if config.inputs.data == "synthetic":
            if self.valid_data is not None:
                raise ConfigError(f"--valid-data {self.valid_data}: synthetic data validates on "
                                  "a stream of its own; drop --valid-data (or train on a text "
                                  "file with --data FILE)")
            return self
        if self.valid_data is None:
            raise ConfigError(f"validation of a text run (--data {config.inputs.data}) needs a "
                              "held-out text file: give --valid-data FILE")
        if not os.path.isfile(self.valid_data):
            raise ConfigError(f"--valid-data: file {self.valid_data!r} does not exist")
        size, seq_len = os.path.getsize(self.valid_data), config.plan.model.seq_length
        if size < seq_len + 2:
            raise ConfigError(f"--valid-data: file {self.valid_data!r} has {size} bytes, fewer "
                              f"than seq_len + 2 = {seq_len + 2}")
        return self


class ValidationData(Protocol):
    """Validation batch ``index`` for one replica, cut as a training step's batch."""

    def microbatches(self, index: int, dp_rank: int, dp: int, m: int
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]: ...


class HeldOutStream:
    """Validation batch ``i`` is ``source``'s batch of step ``-1 - i``: a stream no training
    step reads (steps count from 0)."""

    def __init__(self, source: BatchSource) -> None:
        self.source = source

    def microbatches(self, index: int, dp_rank: int, dp: int, m: int
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if index < 0:
            raise ValueError(f"validation batch index must be >= 0, got {index}")
        return self.source.microbatches(-1 - index, dp_rank, dp, m)


def valid_batches(config: TrainConfig, options: EvalOptions) -> ValidationData:
    """The validation data of ``config``'s data source (see the module docstring)."""
    model = config.plan.model
    if config.inputs.data_path:
        from ..data import IndexedBatches
        from ..datasets import build_dataset

        valid = build_dataset(config, "validation", options.eval_iters * config.global_batch)
        return IndexedBatches(valid, seq_len=model.seq_length, vocab=model.vocab,
                              global_batch=config.global_batch,
                              source="--data-path (its validation split)")
    data = "synthetic" if config.inputs.data == "synthetic" else options.valid_data
    if data is None:
        raise ConfigError(f"validation of a text run (--data {config.inputs.data}) needs "
                          "--valid-data FILE")
    return HeldOutStream(BatchSource(seed=config.runtime.seed, seq_len=model.seq_length,
                                     vocab=model.vocab, global_batch=config.global_batch,
                                     data=data))


@dataclass(frozen=True)
class Evaluation:
    """One evaluation: after ``iteration`` iterations, the mean loss of ``iters`` batches."""

    iteration: int
    loss: float
    iters: int
    seconds: float

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf

    def to_dict(self) -> dict[str, Any]:
        return {"iteration": self.iteration, "loss": self.loss, "iters": self.iters,
                "seconds": self.seconds}
