"""pipeexec: run pipesim schedules for real over torch.distributed (NCCL on GPUs, gloo on CPUs).

The executor walks ``schedule.actions(rank)`` action by action (see runtime.py); everything
that differs between schedules lives in pipesim's builders.

Command line::

    pipeexec train --schedule zbv --pp 2 --vpp 2 --dp 2 --microbatches 8 --layers 6 --steps 10
    torchrun --nproc-per-node 4 -m pipeexec train --schedule interleaved --pp 4 --vpp 2 ...
    pipeexec train --pp 1 --dp 1 ...            # single-process reference

From Python (each process, e.g. under torchrun or `launch`)::

    topo = init_topology(pp, dp, tp=1, cp=1)           # the mesh's groups, passed explicitly
    config = TrainConfig.from_flat(pp=2, layers=4)     # or TrainConfig(plan, sections...)
    trainer = assemble(config, topo)                   # this rank, built once: the plan's
                                                       # model, or pass a stack: gpt_stack(model),
                                                       # hf_dir_stack(DIR) (pipeexec.models.hf),
                                                       # your own LayerStack
    result = train(trainer, on_step=...)               # losses, step_times, ...

Rooms, from the top (each imports only rooms below it; docs/DESIGN.md): ``cli/``; ``run/``
(prepare: a run validated once before launch; assemble: one rank built once; worker, paired
runs, zb-auto's switch, preflight); ``measuring/`` (in the workers); ``training/`` (the step,
the loop and the training state), ``checkpoint/``, ``analysis/`` (torch-free); config
(TrainConfig: a pipesim Plan plus the executor's sections), refusals (what of a plan the
executor cannot run, with reasons); ``models/`` (the layer stack a plan's model is built as),
model, partition, data, ``datasets/``; ``pipeline/`` (the action interpreter with its observers
and stage hooks, p2p, backward, stage, faults); topology, ``parallel/`` (the device mesh;
tensor, sequence, context and expert parallelism); ``launching/`` (the floor: forked workers,
the action board, CPU quotas, devices).
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import Any

from .config import ConfigError, TrainConfig

__all__ = ["ConfigError", "TrainConfig", "WorkerFailed", "launch", "assemble", "LayerStack",
           "gpt_stack", "model_from_layers", "PipelineError", "PipelineRuntime", "Topology", "init_topology",
           "StepStats", "Trainer", "TrainResult", "train"]


# The names that need torch load on first use (as pipesim's heavy ones do), so that the
# torch-free rooms (config, pipeexec.analysis, measuring.profile_options) import without torch even
# where it is installed, and the package imports on a machine without it.
_LAZY = {
    "WorkerFailed": "pipeexec.launching.launcher", "launch": "pipeexec.launching.launcher",
    "assemble": "pipeexec.run.assemble",
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
