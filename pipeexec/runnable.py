"""What of a plan the executor cannot run here, with the reasons: every one at once, before any
process starts (`TrainConfig.validate` raises them as one ConfigError). Torch-free.

pipeexec runs pipeline and data parallelism, fp32 / bf16 / fp16, the recomputation modes, the
built-in GPT and the Hugging Face families of `pipeexec.models`; tensor, context and expert
parallelism, the distributed optimizer and sequence parallelism are the next issues' work.
"""
from __future__ import annotations

from typing import Any

from .models import model_refusals

# parallelism fields the executor does not run yet: (field, flag, value it runs, reason)
_NOT_YET = (
    ("tp", "--tp", 1, "tensor parallelism is not run by pipeexec yet (tp = 1)"),
    ("cp", "--cp", 1, "context parallelism is not run by pipeexec yet (cp = 1)"),
    ("ep", "--ep", 1, "expert parallelism is not run by pipeexec yet (ep = 1: every expert on "
     "every data-parallel rank)"),
    ("zero", "--zero", 0, "pipeexec keeps the full optimizer state on every data-parallel "
     "rank: no distributed optimizer / ZeRO yet (zero = 0)"),
    ("sequence_parallel", "--sequence-parallel", False, "sequence parallelism shards within a "
     "tensor-parallel group, which pipeexec does not run yet"),
)


def refusals(config: Any, *, custom_stack: bool = False) -> list[str]:
    """Why ``config`` (a `TrainConfig`) cannot run here, each naming the field and its flag
    (empty: it can). ``custom_stack``: the caller brings its own layer stack, so the plan's
    model is not built."""
    plan, par = config.plan, config.plan.parallelism
    out = [f"parallelism.{name} = {getattr(par, name)!r} ({flag}): {why}"
           for name, flag, runs, why in _NOT_YET if getattr(par, name) != runs]
    if par.precision == "fp8":
        out.append("parallelism.precision = 'fp8' (--precision): pipeexec computes in fp32, "
                   "bf16 or fp16 (fp8 GEMMs need Transformer Engine, which it does not use)")
    if par.gbs % (par.micro_batch_size * par.dp):
        out.append(f"parallelism.global_batch_size = {par.gbs} (--global-batch-size) is not a "
                   f"multiple of micro_batch_size * dp = {par.micro_batch_size * par.dp}")
    steps = config.steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        out.append(f"steps must be a positive integer (--steps), got {steps!r}")
    if not custom_stack:
        out += model_refusals(plan.model, config.hf_model)
    return out
