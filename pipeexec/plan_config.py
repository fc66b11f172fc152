"""A pipesim `Plan` and a `TrainConfig`: two spellings of one run.

``pipeexec train --plan plan.json`` runs the file `pipesim.Plan.to_json` (or ``pipesim simulate
--save-plan``) writes; the flags build the same Plan (`plan_from_config`), so a run from flags
and the run from its plan file have the same config (`config_from_plan`). What the executor
cannot run yet (tensor, context or expert parallelism, ZeRO, sequence parallelism, a model the
built-in GPT cannot express or, with ``--hf-model DIR``, a model other than that directory's, a
plan's schedule options) is refused with every reason at once, before any process starts.
Torch-free.

The built-in GPT's layer list is [embedding, block x layers, head] (a Hugging Face model's
too: embedding, decoder layers, norm + head); a Plan counts transformer
layers per stage. Stage ``s`` of the plan holding ``n_s`` blocks is pipeexec's stage holding
them, with the embedding on the first stage and the head on the last.
"""
from __future__ import annotations

import dataclasses

from typing import Any

from .config import ConfigError, TrainConfig
from .partition import by_layers

# pipesim Parallelism precision names -> TrainConfig's
_PRECISION = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}


def config_from_plan(plan: Any, base: TrainConfig = TrainConfig(), *,
                     source: str | None = None) -> TrainConfig:
    """The TrainConfig that runs ``plan`` (a `pipesim.Plan`); fields a plan does not hold
    (steps, learning rate, seed, timeouts...) come from ``base``. ``source``: the plan's file;
    a plan holding its schedule as data then runs it from there (``schedule`` = the file,
    which `TrainConfig.build_schedule` reads). Raises ConfigError listing every part of the
    plan the executor does not support."""
    import pipesim

    par, model = plan.parallelism, plan.model
    refused = []
    for name in ("tp", "cp", "ep"):
        if getattr(par, name) != 1:
            refused.append(f"parallelism.{name} = {getattr(par, name)}: pipeexec runs pipeline "
                           "and data parallelism only (tp = cp = ep = 1)")
    if par.zero:
        refused.append(f"parallelism.zero = {par.zero}: pipeexec keeps full optimizer state "
                       "on every data-parallel rank (zero = 0)")
    if par.sequence_parallel:
        refused.append("parallelism.sequence_parallel: needs tp > 1, which pipeexec lacks")
    ffn = model.ffn_hidden if model.ffn_hidden is not None else 4 * model.hidden
    if base.hf_model:
        refused += _hf_model_differences(model, base.hf_model)
    else:
        refused += _gpt_differences(model, ffn)
    if plan.schedule_options:
        refused.append(f"schedule_options {dict(plan.schedule_options)}: give the schedule as "
                       "data (its JSON) or by name alone")
    if isinstance(plan.schedule, pipesim.Schedule) and source is None:
        refused.append(f"schedule: the plan holds a schedule as data ({plan.schedule.name!r}); "
                       "run it from the plan's file (--plan FILE.json), which every rank reads "
                       "it from")
    mbs, dp = par.micro_batch_size, par.dp
    if par.gbs % (mbs * dp):
        refused.append(f"parallelism.global_batch_size = {par.gbs} is not a multiple of "
                       f"micro_batch_size * dp = {mbs * dp}")
    if refused:
        raise ConfigError("the plan asks for what pipeexec cannot run:\n  " + "\n  ".join(refused))
    try:
        blocks = plan.stage_layers()
    except pipesim.PlanError as exc:
        raise ConfigError(str(exc)) from None
    num_layers = model.layers + 2
    bounds = [0]
    for s, n in enumerate(blocks):
        bounds.append(bounds[-1] + n + (1 if s == 0 else 0))
    bounds[-1] += 1                                  # the head
    if any(b0 >= b1 for b0, b1 in zip(bounds, bounds[1:])):
        raise ConfigError(f"partition: blocks per stage {blocks} leave a stage of the built-in "
                          f"GPT (embedding, {model.layers} blocks, head) empty")
    explicit = tuple(bounds[1:-1])
    # the same cut keeps base's spelling of it (explicit, or the default equal counts)
    boundaries = None if (tuple(bounds) == by_layers(num_layers, len(blocks))
                          and base.boundaries != explicit) else explicit
    schedule = source if isinstance(plan.schedule, pipesim.Schedule) else plan.schedule_name
    # the model's shape: the Hugging Face directory's (checked equal above), else the plan's
    shape = {} if base.hf_model else dict(
        layers=model.layers, hidden=model.hidden, heads=model.heads, vocab=model.vocab,
        ffn_mult=ffn // model.hidden, tie_embeddings=model.tied_embeddings)
    return base.replace(
        schedule=schedule, pp=par.pp, vpp=par.vpp, dp=dp,
        microbatches=par.gbs // (mbs * dp), micro_batch_size=mbs, seq_len=model.seq_length,
        precision=_PRECISION[par.precision], partition="layers", boundaries=boundaries,
        recompute=par.recompute, recompute_layers=par.recompute_layers, **shape)


def _gpt_differences(model: Any, ffn: int) -> list[str]:
    """What of a plan's model the built-in GPT cannot express."""
    refused = []
    if model.experts:
        refused.append(f"model.experts = {model.experts}: the built-in GPT is dense (a "
                       "Hugging Face MoE model runs with --hf-model DIR)")
    for name, want in (("mlp", "gelu"), ("norm", "layernorm"), ("position", "learned"),
                       ("bias", True), ("dropout", False)):
        if getattr(model, name) != want:
            refused.append(f"model.{name} = {getattr(model, name)!r}: the built-in GPT has "
                           f"{name} = {want!r} (a Hugging Face model runs with --hf-model DIR)")
    if getattr(model, "qkv_bias", None) is False:
        refused.append("model.qkv_bias = False: the built-in GPT's q, k, v projections have "
                       "biases (a Hugging Face model runs with --hf-model DIR)")
    if model.kv_heads not in (None, model.heads):
        refused.append(f"model.kv_heads = {model.kv_heads}: the built-in GPT has "
                       f"kv_heads = heads = {model.heads}")
    if model.head_dim not in (None, model.hidden // model.heads):
        refused.append(f"model.head_dim = {model.head_dim}: the built-in GPT has hidden / heads")
    if ffn % model.hidden:
        refused.append(f"model.ffn_hidden = {ffn}: the built-in GPT's is a multiple of hidden "
                       f"({model.hidden})")
    return refused


def _hf_model_differences(model: Any, hf_model: str) -> list[str]:
    """Where a plan's model is not the Hugging Face directory's (as
    `pipesim.plan.model.ModelSpec.from_hf_config` reads its config.json)."""
    from pipesim.plan.model import ModelSpec

    from .models.hf_config import HFModelError, read_hf_config

    try:
        read_hf_config(hf_model)
        theirs = ModelSpec.from_hf_config(hf_model, seq_length=model.seq_length).to_dict()
    except (HFModelError, ValueError) as exc:
        return [str(exc)]
    ours = model.to_dict()
    # the vocabulary's padding is the cost model's business: pipeexec never pads
    return [f"model.{k} = {ours.get(k)!r}: --hf-model {hf_model} has {theirs[k]!r}"
            for k in theirs if k not in ("name", "vocab_divisible_by") and ours.get(k) != theirs[k]]


def plan_from_config(config: TrainConfig, *, cluster: Any = None) -> Any:
    """The `pipesim.Plan` of ``config``'s layout and model (the built-in GPT, or its
    ``hf_model`` read by `ModelSpec.from_hf_config`), with its exact
    partition; ``cluster``: a `pipesim.Cluster` (default: the Plan's). Raises ConfigError for a
    partition by parameter counts (its cut needs the model's parameter counts: use
    --boundaries)."""
    import pipesim
    from pipesim.plan.model import ModelSpec
    from pipesim.plan.parallelism import Parallelism

    from .partition import make_partition

    if config.partition != "layers" and config.boundaries is None:
        raise ConfigError("a plan holds an explicit partition: with --partition params, give "
                          "the cut as --boundaries")
    bounds = make_partition(config.num_layers, config.num_stages, "layers", config.boundaries)
    blocks = [min(b1, config.layers + 1) - max(b0, 1) for b0, b1 in zip(bounds, bounds[1:])]
    # the executor does not pad the vocabulary (pipesim's default pads to 128, Megatron's)
    if config.hf_model:                # the shape pipesim's cost model reads from config.json
        model = dataclasses.replace(
            ModelSpec.from_hf_config(config.hf_model, seq_length=config.seq_len),
            vocab_divisible_by=1)
    else:
        model = ModelSpec(name="pipeexec-gpt", layers=config.layers, hidden=config.hidden,
                          heads=config.heads, seq_length=config.seq_len, vocab=config.vocab,
                          ffn_hidden=config.ffn_mult * config.hidden,
                          tied_embeddings=config.tie_embeddings,
                          dropout=False, vocab_divisible_by=1)
    par = Parallelism(pp=config.pp, vpp=config.vpp, dp=config.dp,
                      micro_batch_size=config.micro_batch_size,
                      global_batch_size=config.global_batch, precision=config.precision,
                      recompute=config.recompute, recompute_layers=config.recompute_layers)
    extra = {} if cluster is None else {"cluster": cluster}
    return pipesim.Plan(model, par, schedule=config.schedule, partition=tuple(blocks), **extra)
