"""pipeexec: run pipesim schedules for real over torch.distributed (NCCL on GPUs, gloo on CPUs).

The executor walks ``schedule.actions(rank)`` action by action (see runtime.py); everything
that differs between schedules lives in pipesim's builders.
"""
from .config import ConfigError, TrainConfig
from .launcher import WorkerFailed, launch
from .model import ModelSpec, gpt_spec, model_from_layers
from .runtime import PipelineError, PipelineRuntime
from .topology import Topology, init_topology
from .train import StepStats, Trainer, TrainResult, train

__all__ = ["ConfigError", "TrainConfig", "WorkerFailed", "launch", "ModelSpec", "gpt_spec",
           "model_from_layers", "PipelineError", "PipelineRuntime", "Topology", "init_topology",
           "StepStats", "Trainer", "TrainResult", "train"]
