"""The validation and metrics-logging flags of ``pipeexec train`` (``--eval-interval``,
``--eval-iters``, ``--eval-only``, ``--valid-data``; ``--log-interval``, ``--tensorboard-dir``,
``--wandb-project``, ``--wandb-dir``), generated from `EvalOptions` and `LogOptions`' fields and
checked before any process starts."""
from __future__ import annotations

import argparse

from ..config import ConfigError, TrainConfig
from ..flag_fields import add_arguments, values_from_args
from ..training.metrics_log import LogOptions
from ..training.validation import EvalOptions


def add_monitor_flags(parser: argparse.ArgumentParser) -> None:
    add_arguments(parser.add_argument_group("validation (Megatron-LM's flags)"), EvalOptions)
    add_arguments(parser.add_argument_group("logging"), LogOptions)


def evaluation_from_args(ns: argparse.Namespace, config: TrainConfig) -> EvalOptions:
    """The validation options ``ns`` spells, checked against the run (ConfigError)."""
    options = EvalOptions(**values_from_args(EvalOptions, ns)).validate(config)
    if options.eval_only:
        for flag, given in (("--profile", getattr(ns, "profile", None) is not None),
                            ("--memory-limit", config.layout.memory_limit is not None)):
            if given:
                raise ConfigError(f"--eval-only trains no step for {flag} to profile; drop "
                                  f"one of them")
    return options


def logging_from_args(ns: argparse.Namespace) -> LogOptions:
    """The logging options ``ns`` spells, checked (ConfigError names a missing package)."""
    return LogOptions(**values_from_args(LogOptions, ns)).validate()
