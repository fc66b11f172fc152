"""The layer stack a plan's model is built as: the built-in GPT (`pipeexec.model`) when the
plan's `ModelSpec` has no family, else that Hugging Face family's own modules
(`pipeexec.models.hf`), from the config the spec spells (`hf_config.config_for`) and, with
``--hf-model DIR``, DIR's weights. Importing this package imports no torch: what can be built
is decided (`model_refusals`) before any worker starts, on machines without it."""
from __future__ import annotations

from typing import Any

from ..errors import ConfigError

# the built-in GPT's fixed choices: (field, value, what the GPT has)
_GPT_FIXED = (("mlp", "gelu"), ("norm", "layernorm"), ("position", "learned"), ("bias", True),
              ("dropout", False))


def gpt_differences(model: Any) -> list[str]:
    """What of ``model`` (a `pipesim.ModelSpec` without a family) the built-in GPT cannot
    build: it is dense, GeLU, LayerNorm, learned positions, biases, no dropout, kv_heads =
    heads, head_dim = hidden / heads."""
    hint = ("; a plan made from a Hugging Face config.json (pipesim plan --model DIR, DIR "
            "holding config.json; a preset's: pipesim models NAME --config-out DIR) names its "
            "family and runs as that family's model")
    refused = []
    if model.experts:
        refused.append(f"model.experts = {model.experts}: the built-in GPT is dense{hint}")
    for name, want in _GPT_FIXED:
        if getattr(model, name) != want:
            refused.append(f"model.{name} = {getattr(model, name)!r}: the built-in GPT has "
                           f"{name} = {want!r}{hint}")
    if model.qkv_bias is False:
        refused.append("model.qkv_bias = False: the built-in GPT's q, k, v projections have "
                       f"biases{hint}")
    if model.num_kv_heads != model.heads:
        refused.append(f"model.kv_heads = {model.kv_heads} (--kv-heads): the built-in GPT has "
                       f"kv_heads = heads = {model.heads}{hint}")
    if model.hidden % model.heads:
        refused.append(f"model.hidden = {model.hidden} must be divisible by model.heads = "
                       f"{model.heads} (--hidden, --heads)")
    elif model.kv_channels != model.hidden // model.heads:
        refused.append(f"model.head_dim = {model.head_dim}: the built-in GPT has hidden / heads "
                       f"= {model.hidden // model.heads}")
    if model.max_position is not None and model.max_position < model.seq_length:
        refused.append(f"model.max_position = {model.max_position} is shorter than "
                       f"model.seq_length = {model.seq_length} (--seq-len)")
    return refused


def model_refusals(model: Any, hf_model: str | None = None) -> list[str]:
    """Why the executor cannot build ``model`` (empty: it can), with ``hf_model`` the
    directory whose weights it would load."""
    if model.family is None:
        if hf_model is not None:
            return [f"--hf-model {hf_model}: the plan's model is the built-in GPT's shape (no "
                    "family), not that directory's config.json; drop --hf-model, or make the "
                    f"plan with --model {hf_model}"]
        return gpt_differences(model)
    from .hf_config import model_refusals as family_refusals

    return family_refusals(model, hf_model)


def worker_modules(config: Any) -> tuple[str, ...]:
    """What a rank of ``config``'s run (a `TrainConfig`) imports to build its layers beyond
    pipeexec's worker code: for a Hugging Face family, pipeexec's adapter and the family's
    modeling module (with it transformers' hub, loss and generation code, about a CPU second
    a rank). A launcher that forks the ranks imports them once first, so that the ranks share
    them (`pipeexec.launching.launcher.launch`'s ``preload``); the built-in GPT needs none."""
    family = config.plan.model.family
    if family is None:
        return ()
    from .hf_config import modeling_module

    return ("pipeexec.models.hf", modeling_module(family))


def layer_stack(config: Any, tp: Any = None, cp: Any = None, ep: Any = None):
    """The `pipeexec.model.LayerStack` ``config`` (a `TrainConfig`) trains: its plan's model,
    as the built-in GPT or its Hugging Face family (weights from ``config.hf_model``); ``tp``:
    this rank's `pipeexec.parallel.regions.TensorParallel` (None: tp 1); ``cp``: its
    `pipeexec.parallel.context.ContextParallel` (None: cp 1); ``ep``: its
    `pipeexec.parallel.experts.ExpertParallel` (None: ep 1; a MoE family's experts cut,
    `hf_expert_parallel`). Raises ConfigError when the model cannot be built here."""
    refused = model_refusals(config.plan.model, config.inputs.hf_model)
    if refused:
        raise ConfigError("the plan's model cannot be built here:\n  " + "\n  ".join(refused))
    return checked_layer_stack(config, tp, cp, ep)


def checked_layer_stack(config: Any, tp: Any = None, cp: Any = None, ep: Any = None):
    """`layer_stack` of a config validated already (`TrainConfig.validate` refused what
    cannot be built): a rank of a launched run builds its stack without checking again."""
    model = config.plan.model
    from ..parallel import context
    from ..parallel.regions import NONE
    if model.family is not None:
        from .hf import hf_layer_stack
        stack = hf_layer_stack(model, weights=config.inputs.hf_model, tp=tp or NONE,
                               cp=cp or context.NONE)
        if ep is not None and ep.active:
            from .hf_expert_parallel import expert_parallel_stack
            stack = expert_parallel_stack(stack, model.family, ep)
        return stack
    if ep is not None and ep.active:
        raise ConfigError("expert parallelism: the built-in GPT is dense (no experts)")
    from ..model import gpt_stack
    return gpt_stack(model, tp or NONE, cp or context.NONE)
