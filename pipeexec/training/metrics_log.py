"""Training metrics as they happen: TensorBoard event files and W&B (offline) runs.

``--tensorboard-dir DIR`` writes scalars every ``--log-interval`` iterations with
``torch.utils.tensorboard.SummaryWriter`` (the ``tensorboard`` package, not tensorflow: the
``monitor`` extra); ``--wandb-project NAME`` logs the same scalars to a W&B run (the
``wandb`` extra) in offline mode (``WANDB_MODE=offline`` unless the environment sets another
mode; ``wandb sync`` uploads it later). A missing package is refused before any process
starts (`LogOptions.validate`).

One rank writes: the one that holds the loss, i.e. the last pipeline stage's rank that is
first of its data-, context- and tensor-parallel groups (`writes_metrics`); the loss, the
gradient norm and the validation loss are all-reduced, so its values are the run's.

Scalars (`step_scalars`; a NaN, e.g. CUDA memory on CPU, is left out): ``train/loss``,
``train/lr``, ``train/grad_norm``, ``train/loss_scale``, ``train/step_time_s``,
``train/tokens_per_s``, ``train/mfu`` (model FLOPs, pipesim's `model_flops`, over the step
time times world size times the peak of the plan's hardware: ``--plan``'s cluster, H100 by
default), memory
(``train/max_memory_allocated_bytes`` and ``..._reserved_bytes`` on CUDA, the writer's peak
RSS ``train/max_rss_bytes`` on CPU), ``train/skipped_steps`` (fp16 overflows so far in this
run); and at each evaluation ``valid/loss`` and ``valid/ppl``. The x axis is the iteration count after the
step (the checkpoints' numbering: iteration 1 is the first step's).
"""
from __future__ import annotations

import importlib.util
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Protocol

from ..config import ConfigError, TrainConfig
from ..flag_fields import option


def _missing(package: str) -> bool:
    return importlib.util.find_spec(package) is None


@dataclass(frozen=True)
class LogOptions:
    """The metrics-logging concern of a run; its flags are generated from these fields."""

    log_interval: int = option(1, "print a step line, and write TensorBoard / W&B scalars, "
                               "every N iterations", type=int, metavar="N")
    tensorboard_dir: str | None = option(
        None, "write TensorBoard scalars (loss, validation loss, lr, grad norm, loss scale, "
        "step time, tokens/s, MFU, memory, skipped steps) to DIR (needs the tensorboard "
        "package: pip install 'pipesim[monitor]')", metavar="DIR")
    wandb_project: str | None = option(
        None, "log the same scalars to a W&B run of this project, offline (WANDB_MODE=offline "
        "unless set; 'wandb sync' uploads it; needs the wandb package)", metavar="NAME")
    wandb_dir: str | None = option(None, "where the offline W&B run is written (default: "
                                   "wandb's, ./wandb)", metavar="DIR")

    @property
    def active(self) -> bool:
        return self.tensorboard_dir is not None or self.wandb_project is not None

    def validate(self) -> "LogOptions":
        """Raise ConfigError naming the flag (or the package to install); checked before any
        process starts."""
        v = self.log_interval
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"--log-interval must be a positive integer, got {v!r}")
        if self.tensorboard_dir is not None:
            if not self.tensorboard_dir:
                raise ConfigError("--tensorboard-dir: give a directory")
            if os.path.exists(self.tensorboard_dir) and not os.path.isdir(self.tensorboard_dir):
                raise ConfigError(f"--tensorboard-dir {self.tensorboard_dir}: exists and is not "
                                  "a directory")
            if _missing("tensorboard"):
                raise ConfigError(f"--tensorboard-dir {self.tensorboard_dir} needs the "
                                  "tensorboard package (torch.utils.tensorboard writes with it; "
                                  "tensorflow is not needed): pip install tensorboard, or "
                                  "pip install 'pipesim[monitor]'")
        if self.wandb_project is not None:
            if not self.wandb_project:
                raise ConfigError("--wandb-project: give a project name")
            if _missing("wandb"):
                raise ConfigError(f"--wandb-project {self.wandb_project} needs the wandb "
                                  "package: pip install wandb (or pip install "
                                  "'pipesim[wandb]')")
        elif self.wandb_dir is not None:
            raise ConfigError("--wandb-dir needs --wandb-project")
        return self


class MetricsSink(Protocol):
    def scalars(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """Scalars into TensorBoard event files under ``log_dir``."""

    def __init__(self, log_dir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=log_dir)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Scalars into a W&B run, offline unless ``WANDB_MODE`` says otherwise."""

    def __init__(self, project: str, config: dict[str, Any], directory: str | None) -> None:
        import wandb

        if directory is not None:
            os.makedirs(directory, exist_ok=True)
        self.run = wandb.init(project=project, config=config, dir=directory,
                              mode=os.environ.get("WANDB_MODE", "offline"))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


def writes_metrics(topology: Any, holds_last_stage: bool) -> bool:
    """Whether this rank writes the metrics: it holds the last stage (the loss) and is the
    first of its data-, context- and tensor-parallel groups."""
    return (holds_last_stage and topology.dp_rank == 0 and topology.cp_rank == 0
            and topology.tp_rank == 0)


def open_sinks(options: LogOptions | None, config: TrainConfig) -> list[MetricsSink]:
    """The sinks ``options`` asks for (call on the writing rank only)."""
    if options is None:
        return []
    sinks: list[MetricsSink] = []
    if options.tensorboard_dir is not None:
        sinks.append(TensorBoardSink(options.tensorboard_dir))
    if options.wandb_project is not None:
        sinks.append(WandbSink(options.wandb_project, config.to_dict(), options.wandb_dir))
    return sinks


def model_flops_per_step(config: TrainConfig) -> float:
    """The model FLOPs of one optimizer step (forward and backward of the global batch), as
    pipesim counts them for MFU (`pipesim.plan.flops.model_flops`)."""
    from pipesim.plan.flops import model_flops

    return model_flops(config.plan.model, config.global_batch, tp=config.plan.parallelism.tp,
                       causal=config.plan.parallelism.flash_attention)


def mfu(config: TrainConfig, flops: float, step_time: float) -> float:
    """Model FLOPs utilisation of a step against the plan's hardware peak."""
    peak = config.plan.cluster.hardware.peak_flops
    if step_time <= 0 or peak <= 0:
        return math.nan
    return flops / (step_time * config.world_size * peak)


def _max_rss_bytes() -> float:
    try:
        import resource
    except ImportError:            # not on POSIX
        return math.nan
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(kib if sys.platform == "darwin" else kib * 1024)


def step_scalars(stats: Any, config: TrainConfig, flops: float, skipped_total: int
                 ) -> dict[str, float]:
    """The scalars of one step's `StepStats` (finite values only)."""
    values = {
        "train/loss": stats.loss, "train/lr": stats.lr, "train/grad_norm": stats.grad_norm,
        "train/loss_scale": stats.loss_scale, "train/step_time_s": stats.step_time,
        "train/tokens_per_s": stats.tokens_per_s, "train/mfu": mfu(config, flops, stats.step_time),
        "train/skipped_steps": float(skipped_total),
        "train/max_memory_allocated_bytes": stats.max_memory_allocated,
        "train/max_memory_reserved_bytes": stats.max_memory_reserved,
    }
    if math.isnan(stats.max_memory_allocated):
        values["train/max_rss_bytes"] = _max_rss_bytes()
    return {k: float(v) for k, v in values.items() if math.isfinite(v)}


def valid_scalars(loss: float) -> dict[str, float]:
    values = {"valid/loss": loss, "valid/ppl": math.exp(loss) if loss < 700 else math.inf}
    return {k: v for k, v in values.items() if math.isfinite(v)}
