"""pipeexec: run pipesim schedules for real over torch.distributed (NCCL on GPUs, gloo on CPUs).

The executor walks ``schedule.actions(rank)`` action by action (see runtime.py); everything
that differs between schedules lives in pipesim's builders.

Command line::

    pipeexec train --schedule zbv --pp 2 --vpp 2 --dp 2 --microbatches 8 --layers 6 --steps 10
    torchrun --nproc-per-node 4 -m pipeexec train --schedule interleaved --pp 4 --vpp 2 ...
    pipeexec train --pp 1 --dp 1 ...            # single-process reference

From Python (each process, e.g. under torchrun or `launch`)::

    topo = init_topology(pp, dp, tp=1, cp=1)           # the mesh's groups, passed explicitly
    trainer = Trainer(TrainConfig(...), topo)          # the plan's model; or pass a stack:
                                                       # gpt_stack(model), hf_dir_stack(DIR)
                                                       # (pipeexec.models.hf), your own LayerStack
    result = train(trainer, on_step=...)               # losses, step_times, ...

Rooms: config (TrainConfig: a pipesim Plan plus the executor's sections), runnable (what of a
plan the executor cannot run, with reasons), topology, model (LayerStack, the built-in GPT),
partition, data; ``parallel/`` (the device mesh; tensor, sequence and context parallelism);
``models/`` (the layer stack a plan's model is built as: the built-in GPT or a Hugging Face
family, weights from ``--hf-model DIR``); ``pipeline/`` (runtime, the action interpreter with
its observers and stage hooks; p2p; backward; stage; faults), ``launching/`` (launcher, worker,
board, cpu_quota, devices, preflight), ``training/`` (train, ddp, tied, precision, optim, zero,
flat), ``checkpoint/``, ``measuring/`` (in the workers), ``analysis/`` (torch-free: run_plan,
measured, calibrate, contention, predict, compare, tensor_parallel); ``cli/``.
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from .config import ConfigError, TrainConfig

__all__ = ["ConfigError", "TrainConfig", "WorkerFailed", "launch", "LayerStack", "gpt_stack",
           "model_from_layers", "PipelineError", "PipelineRuntime", "Topology", "init_topology",
           "StepStats", "Trainer", "TrainResult", "train"]


# The names that need torch load on first use (as pipesim's heavy ones do), so that the
# torch-free rooms (config, pipeexec.analysis, measuring.options) import without torch even
# where it is installed, and the package imports on a machine without it.
_LAZY = {
    "WorkerFailed": "pipeexec.launching.launcher", "launch": "pipeexec.launching.launcher",
    "LayerStack": "pipeexec.model", "gpt_stack": "pipeexec.model",
    "model_from_layers": "pipeexec.model",
    "PipelineError": "pipeexec.pipeline.runtime", "PipelineRuntime": "pipeexec.pipeline.runtime",
    "Topology": "pipeexec.topology", "init_topology": "pipeexec.topology",
    "StepStats": "pipeexec.training.train", "Trainer": "pipeexec.training.train",
    "TrainResult": "pipeexec.training.train", "train": "pipeexec.training.train",
}


def _torch_installed() -> bool:
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):      # blocked (sys.modules["torch"] = None)
        return False


if not _torch_installed():
    __all__ = ["ConfigError", "TrainConfig"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pipeexec' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
