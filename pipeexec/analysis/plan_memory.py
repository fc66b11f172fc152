"""Activation memory predicted from the model's shape alone: what pipesim says a run will hold.

The other predictions of this room start from a measured run (calibrated bytes). This one
needs no run: the config's `pipesim.Plan` (`TrainConfig.run_plan`: the plan as the run cuts it) gives each
stage's activation bytes per microbatch from the model shape (Korthikanti et al.'s formulas,
`pipesim.plan.footprint`, at the precision's element size), the share W needs, and the
message size (the share held from a split backward's I to its W as pipeexec holds it,
`executor_split`); pipesim's memory model replays them over the schedule the executor runs (with
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
from pipesim.plan.footprint import BYTES_PER_PARAM

from .hf_activations import stage_extras
from .predict import EXECUTOR_COMM
from .tensor_parallel import as_executed


def predicted_activation_peaks(config: Any, schedule: "pipesim.Schedule | None" = None
                               ) -> list[float]:
    """Per pipeline rank, the peak activation bytes pipesim predicts for ``config`` (a
    `TrainConfig`) from its plan, on ``schedule`` (default: the one the config runs)."""
    plan = as_executed(config.plan_as_run())      # cp as pipeexec runs it: all-gather
    sched = config.build_schedule() if schedule is None else schedule
    costs = executor_split(as_built(plan.derive().costs, plan), plan, sched)
    costs = replace(costs, static_bytes=0.0, stage_static_bytes=0.0)
    if not config.runtime.deallocate_outputs:
        costs = _outputs_kept(costs, sched)
    result = pipesim.simulate(sched, costs, comm=EXECUTOR_COMM)
    return [float(x) for x in result.peak_memory]


def predicted_peaks(config: Any, schedule: "pipesim.Schedule | None" = None) -> list[float]:
    """Per pipeline rank, the peak bytes pipesim predicts the rank holds, its training state
    included (what `pipeexec.measuring.memory.TrainingMemoryMeter` reads): the plan's weights,
    gradients and optimizer state at its ``zero`` level (Megatron's bytes per parameter,
    `pipesim.plan.footprint.param_bytes`) plus the activations as in
    `predicted_activation_peaks`, with what pipeexec does its own way:

    * ZeRO-3 gathers whole stages (`pipeexec.training.zero`), not pipesim's two layers: a
      stage's weights (compute dtype) are whole through each of its actions, the rank's
      largest stage the transient (reducing once a microbatch, its gradients go a bucket, a
      layer, at a time, inside the backward, as ZeRO-2's: the meter, reading around actions,
      sees no gradient transient, so pipesim's one bucket is left out here; reducing once a
      step, the plan's gradients are the whole buffer, as pipeexec's);
    * ZeRO-2/3 keep tied parameters' gradients whole (fp32) for the step: the embedding and
      the head's copy of it, and every parameter of a model part held by two stages (dualpipe).

    The transient of a block recomputed inside its backward is left out on both sides (the
    meter reads around each action, after it)."""
    plan = as_executed(config.plan_as_run())      # cp as pipeexec runs it: all-gather
    derived = plan.derive()
    par, model = plan.parallelism, plan.model
    sched = config.build_schedule() if schedule is None else schedule
    d = par.dp * par.cp
    weight_bytes = BYTES_PER_PARAM[par.precision][0]
    held = {}
    for st in range(sched.num_stages):
        held[sched.stage_part(st)] = held.get(sched.stage_part(st), 0) + 1
    last_part = len(derived.stage_params) - 1
    embedding = model.padded_vocab(par.tp) * model.hidden / par.tp
    transient, tied_extra = [], []
    for r in range(sched.pp):
        stage_params = []
        tied = 0.0
        for st in sched.rank_stages(r):
            part = sched.stage_part(st)
            n = sum(derived.stage_params[part].values())
            stage_params.append(n)
            if held[part] > 1:                  # a copy: every parameter tied
                tied += n
            elif model.tied_embeddings:         # the embedding, and the head's instance of it
                tied += embedding * ((part == 0) + (part == last_part))
        largest = max(stage_params, default=0.0)
        transient.append(weight_bytes * largest if par.zero == 3 and d > 1 else 0.0)
        # (beside the shard accumulator, which the plan counts, as for every parameter)
        tied_extra.append(4 * tied if par.zero >= 2 and d > 1 else 0.0)
    costs = replace(executor_split(as_built(derived.costs, plan), plan, sched),
                    static_bytes=tuple(a + b for a, b in zip(transient, tied_extra)))
    if not config.runtime.deallocate_outputs:
        costs = _outputs_kept(costs, sched)
    result = pipesim.simulate(sched, costs, comm=EXECUTOR_COMM)
    return [float(x) for x in result.peak_memory]


def as_built(costs: "pipesim.CostModel", plan: "pipesim.Plan") -> "pipesim.CostModel":
    """The plan's activation bytes, plus, for a model built as a Hugging Face family (a plan
    that names one, with or without ``--hf-model`` weights: `pipeexec.models.layer_stack`),
    what its transformers modules save beyond the formulas (`hf_activations`)."""
    if plan.model.family is None:
        return costs
    n = len(plan.stage_layers())
    act = costs.stage_values("activation_bytes", n)
    return replace(costs, activation_bytes=tuple(
        a + x for a, x in zip(act, stage_extras(plan))))


def executor_split(costs: "pipesim.CostModel", plan: "pipesim.Plan",
                   schedule: "pipesim.Schedule") -> "pipesim.CostModel":
    """The share of a stage's activations held from its I to its W, as pipeexec's split
    backward holds it (`pipeexec.pipeline.backward`: I runs with ``retain_graph`` so that W
    finds its join nodes' saved tensors; the graph is freed only by W). The plan's share is
    Zero Bubble's (W keeps only its linear layers' inputs: Qi et al. 2023, what Megatron's
    zero-bubble fork stores in its weight-gradient store); here every block keeps all of it,
    and the head's I frees only the loss computation's saved fp32 logits, which W does not
    need. The recorded output gradients W reads come on top in the executor and are left out
    (the memory model cannot grow a stage's bytes at its I).

    The plan's costs are per model part: they are first spread onto ``schedule``'s stages
    (`CostModel.for_schedule`), more than the parts where a rank holds a copy (dualpipe: 2 pp
    stages over pp parts), so that what follows reads one value per stage."""
    costs = costs.for_schedule(schedule)
    n = schedule.num_stages
    act = costs.stage_values("activation_bytes", n)
    model, par = plan.model, plan.parallelism
    logits = (4 * par.micro_batch_size * model.seq_length / par.cp
              * model.padded_vocab(par.tp) / par.tp)
    last_part = schedule.num_parts - 1
    frac = []
    for s in range(n):
        freed = logits if schedule.stage_part(s) == last_part else 0.0
        frac.append(max(0.0, 1.0 - freed / act[s]) if act[s] > 0 else 1.0)
    return replace(costs, weight_grad_fraction=tuple(frac))


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
