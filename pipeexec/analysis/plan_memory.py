"""Activation memory predicted from the model's shape alone: what pipesim says a run will hold.

The other predictions of this room start from a measured run (calibrated bytes). This one
needs no run: the config's `pipesim.Plan` (`TrainConfig.run_plan`: the plan as the run cuts it) gives each
stage's activation bytes per microbatch from the model shape (Korthikanti et al.'s formulas,
`pipesim.plan.footprint`, at the precision's element size), the share W needs, and the
message size; pipesim's memory model replays them over the schedule the executor runs (with
its ``recv_lookahead``), receive and send buffers included. Torch-free.

The quantity both sides share, per rank: the largest sum, at an action boundary, of

* each in-flight (stage, microbatch)'s saved activations: without recomputation what the
  layers' backward needs; ``selective``: the same less the core attention's (with fused
  attention as on CPU, its log-sum-exp); ``full``: each recomputed block's input only, plus the
  embedding's token ids and the head's norm and logits, which are never recomputed;
* the output of the F that just ran, until it is sent to the next rank (with
  ``--no-deallocate-outputs``, until its backward starts: then part of the stage's
  activations);
* the posted receive buffers (an activation ahead of its F, a gradient until its backward).

The meter (`pipeexec.measuring.memory.HeldTensorMeter`) counts exactly the tensors behind these;
parameters, gradients and optimizer state are static bytes and left out on both sides. The
formulas omit the norms' per-token statistics and the loss's labels (a few per cent at toy
widths, about ``1/(4h)`` of a layer), and the transient activations of a block recomputed inside its
backward, which the meter does not see between actions either.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import pipesim

from .predict import EXECUTOR_COMM


def predicted_activation_peaks(config: Any, schedule: "pipesim.Schedule | None" = None
                               ) -> list[float]:
    """Per pipeline rank, the peak activation bytes pipesim predicts for ``config`` (a
    `TrainConfig`) from its plan, on ``schedule`` (default: the one the config runs)."""
    plan = config.run_plan()
    costs = plan.derive().costs
    costs = replace(costs, static_bytes=0.0, stage_static_bytes=0.0)
    sched = config.build_schedule() if schedule is None else schedule
    if not config.deallocate_outputs:
        costs = _outputs_kept(costs, sched)
    result = pipesim.simulate(sched, costs, comm=EXECUTOR_COMM)
    return [float(x) for x in result.peak_memory]


def _outputs_kept(costs: "pipesim.CostModel", schedule: "pipesim.Schedule") -> "pipesim.CostModel":
    """Without Megatron's deallocation an output sent to another rank stays until the stage's
    backward (B or I) starts: one more message of activations per (stage, microbatch) on those
    stages, none of it left for W."""
    n = schedule.num_stages
    act = costs.stage_values("activation_bytes", n)
    frac = costs.stage_values("weight_grad_fraction", n)
    out = costs.stage_values("p2p_bytes", n)
    for s in range(n - 1):
        if schedule.stage_rank(s + 1) != schedule.stage_rank(s) and out[s] > 0:
            kept = act[s] * frac[s]
            act[s] += out[s]
            frac[s] = kept / act[s]
    return replace(costs, activation_bytes=tuple(act), weight_grad_fraction=tuple(frac))
