"""pipeexec: run pipesim schedules for real over torch.distributed (NCCL on GPUs, gloo on CPUs).

The executor walks ``schedule.actions(rank)`` action by action (see runtime.py); everything
that differs between schedules lives in pipesim's builders.

Command line::

    pipeexec train --schedule zbv --pp 2 --vpp 2 --dp 2 --microbatches 8 --layers 6 --steps 10
    torchrun --nproc-per-node 4 -m pipeexec train --schedule interleaved --pp 4 --vpp 2 ...
    pipeexec train --pp 1 --dp 1 ...            # single-process reference

From Python (each process, e.g. under torchrun or `launch`)::

    topo = init_topology(pp, dp)                       # explicit pp / dp groups
    trainer = Trainer(TrainConfig(...), topo, spec)    # spec: gpt_spec(...) or your own ModelSpec
    result = train(trainer, on_step=...)               # losses, step_times, ...

Modules: config (TrainConfig), topology (ranks and groups), model (layer lists, GPT),
partition (layers -> stages), stage, data, p2p (tagged async send/recv with timeouts),
backward (B, and the I/W split), runtime (the interpreter), ddp (fp32 gradient buffer,
all-reduce), precision (master weights, loss scaling), optim (AdamW, LR, clipping),
train (step and loop), launcher (forked local workers), board (which action each rank is in),
preflight (checks of a command before any worker starts), worker and cli (entry points).
"""
from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

# Names resolve on first use (PEP 562), so the torch-free rooms (config, partition, the
# measuring room pipeexec.profile's calibrate / predict / compare / run_plan) import on a machine
# without torch; the rest imports torch when first touched.
_EXPORTS = {"ConfigError": "config", "TrainConfig": "config", "WorkerFailed": "launcher",
            "launch": "launcher", "ModelSpec": "model", "gpt_spec": "model",
            "model_from_layers": "model", "PipelineError": "runtime",
            "PipelineRuntime": "runtime", "Topology": "topology", "init_topology": "topology",
            "StepStats": "train", "Trainer": "train", "TrainResult": "train", "train": "train"}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from .config import ConfigError, TrainConfig
    from .launcher import WorkerFailed, launch
    from .model import ModelSpec, gpt_spec, model_from_layers
    from .runtime import PipelineError, PipelineRuntime
    from .topology import Topology, init_topology
    from .train import StepStats, Trainer, TrainResult, train


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'pipeexec' has no attribute {name!r}")
