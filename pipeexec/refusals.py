"""What of a plan the executor cannot run here, with the reasons: every one at once, before any
process starts (`TrainConfig.validate` raises them as one ConfigError). Torch-free.

pipeexec runs pipeline, data, tensor (with sequence parallelism), context and expert
parallelism (a MoE family's experts over ep ranks of dp x cp), fp32 / bf16 / fp16, the
recomputation modes, ZeRO 1-3 (the distributed optimizer; with dp x cp 1 a no-op, as in
Megatron), the built-in GPT and the Hugging Face families of `pipeexec.models`.
"""
from __future__ import annotations

from typing import Any

from .models import model_refusals

# parallelism fields the executor does not run yet: (field, flag, value it runs, reason)
_NOT_YET: tuple[tuple[str, str, Any, str], ...] = ()


def refusals(config: Any, *, custom_stack: bool = False) -> list[str]:
    """Why ``config`` (a `TrainConfig`) cannot run here, each naming the field and its flag
    (empty: it can). ``custom_stack``: the caller brings its own layer stack, so the plan's
    model is not built."""
    plan, par = config.plan, config.plan.parallelism
    out = [f"parallelism.{name} = {getattr(par, name)!r} ({flag}): {why}"
           for name, flag, runs, why in _NOT_YET if getattr(par, name) != runs]
    if par.precision in ("fp8", "mxfp8", "nvfp4"):
        out.append(f"parallelism.precision = {par.precision!r} (--precision): pipeexec computes "
                   f"in fp32, bf16 or fp16 ({par.precision} GEMMs need Transformer Engine, which "
                   "it does not use)")
    if par.grad_reduce_in_fp32 is False:
        out.append("parallelism.grad_reduce_in_fp32 = False (--no-grad-reduce-in-fp32): "
                   "pipeexec accumulates and reduces gradients in fp32 (drop the flag)")
    if par.gbs % (par.micro_batch_size * par.dp):
        out.append(f"parallelism.global_batch_size = {par.gbs} (--global-batch-size) is not a "
                   f"multiple of micro_batch_size * dp = {par.micro_batch_size * par.dp}")
    steps = config.optimizer.steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        out.append(f"steps must be a positive integer (--steps), got {steps!r}")
    if not custom_stack:
        out += model_refusals(plan.model, config.inputs.hf_model)
        out += tensor_parallel_refusals(plan.model, par)
    out += context_parallel_refusals(plan.model, par)
    out += expert_parallel_refusals(plan.model, par, custom_stack=custom_stack)
    out += memory_refusals(par)
    return out


def memory_refusals(par: Any) -> list[str]:
    """What pipesim plans for memory that pipeexec does not run: Megatron's per-module
    selective recomputation and activation offloading to host memory."""
    out = []
    if par.recompute_modules:
        out.append(f"parallelism.recompute_modules = {list(par.recompute_modules)} (a plan "
                   "file's field): pipeexec recomputes the core attention (recompute "
                   "selective) or whole blocks (full), not Megatron's per-module list; drop it "
                   "or re-plan with --recompute selective / full")
    if par.offload_layers:
        out.append(f"parallelism.offload_layers = {par.offload_layers} (a plan file's field): "
                   "pipeexec keeps every activation on its device; set it to 0")
    return out


# the Hugging Face families whose experts pipeexec.models.hf_expert_parallel cuts over ep
EXPERT_PARALLEL_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")


def expert_parallel_refusals(model: Any, par: Any, *, custom_stack: bool = False) -> list[str]:
    """What does not run over ``par.ep`` expert-parallel ranks (`pipeexec.parallel.experts`):
    ep is carved out of dp x cp (Megatron's expert layout), so it must divide dp * cp; each
    rank holds E / ep whole experts of a MoE model (ZeRO shards them over the
    expert-data-parallel group, `training.zero.ExpertShardedOptimizer`)."""
    ep = par.ep
    if ep == 1:
        return []
    flag = f"parallelism.ep = {ep} (--ep)"
    out = []
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        return [f"{flag}: must be a positive integer"]
    if par.ep_dispatcher != "alltoall":
        out.append(f"parallelism.ep_dispatcher = {par.ep_dispatcher!r} (--ep-dispatcher): "
                   "pipeexec moves the routed tokens with torch.distributed's all-to-all "
                   "(Megatron's 'alltoall' dispatcher); DeepEP and HybridEP are priced by pipesim "
                   "for planning only: set it to 'alltoall' to run the plan")
    if par.overlap_ep_comm:
        out.append("parallelism.overlap_ep_comm = True (a plan file's field): pipeexec does not "
                   "hide the expert all-to-all under another microbatch's compute: set it to "
                   "false to run the plan")
    if (par.dp * par.cp) % ep:
        out.append(f"{flag} must divide dp * cp = {par.dp} * {par.cp} = {par.dp * par.cp} "
                   "(--dp, --cp): expert parallelism is carved out of data x context "
                   "parallelism; the world size stays tp * cp * dp * pp")
    if not custom_stack:
        if not model.experts:
            out.append(f"{flag}: the model is dense (no experts; the built-in GPT is dense): "
                       "expert parallelism needs a MoE model, e.g. a plan made from a Mixtral "
                       "config.json")
        elif model.experts % ep:
            out.append(f"{flag}: the model's {model.experts} experts (model.experts) are not "
                       f"divisible by ep: each ep rank holds experts / ep of them")
        elif model.family not in EXPERT_PARALLEL_FAMILIES:
            out.append(f"{flag}: expert parallelism runs the Hugging Face families "
                       f"{', '.join(EXPERT_PARALLEL_FAMILIES)}; model.family is "
                       f"{model.family!r}")
    return out


def context_parallel_refusals(model: Any, par: Any) -> list[str]:
    """What does not cut over ``par.cp`` ranks: each sequence is cut into ``2 cp``
    load-balanced chunks (`pipeexec.parallel.context`), and under sequence parallelism each cp
    rank's part is cut again into tp chunks (Megatron's rule: a multiple of ``2 cp tp``);
    attention dropout cannot be recomputed alike in the backward (the attention's backward
    recomputes its forward)."""
    cp = par.cp
    if cp == 1:
        return []
    out = []
    s = model.seq_length
    if s % (2 * cp):
        out.append(f"parallelism.cp = {cp} (--cp): model.seq_length = {s} (--seq-len) is not a "
                   f"multiple of 2 * cp = {2 * cp}: context parallelism cuts each sequence into "
                   "2 cp load-balanced chunks (rank i holds chunks i and 2 cp - 1 - i)")
    elif par.sequence_parallel and par.tp > 1 and s % (2 * cp * par.tp):
        out.append(f"parallelism.cp = {cp} (--cp) with sequence parallelism: model.seq_length = "
                   f"{s} (--seq-len) is not a multiple of 2 * cp * tp = {2 * cp * par.tp}: each "
                   "cp rank's chunks are cut again into tp sequence-parallel chunks")
    if model.dropout:
        out.append(f"parallelism.cp = {cp} (--cp): the model has dropout (model.dropout): "
                   "context parallelism recomputes the attention in its backward, which would "
                   "draw other dropout masks")
    return out


# the Hugging Face families pipeexec.models.hf_tensor_parallel cuts over tp
_TENSOR_PARALLEL_FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3_moe",
                             "gpt2")


def tensor_parallel_refusals(model: Any, par: Any) -> list[str]:
    """What of the model does not cut over ``par.tp`` ranks (each dimension a tp-parallel
    layer splits must be a multiple of tp): the built-in GPT and the Hugging Face families
    of `pipeexec.models.hf` (`pipeexec.models.hf_tensor_parallel`: GQA's kv heads cut, not
    replicated; Mixtral's experts each cut as a dense MLP)."""
    tp = par.tp
    if tp == 1:
        return []
    out = []
    if model.family is not None and model.family not in _TENSOR_PARALLEL_FAMILIES:
        return [f"parallelism.tp = {tp} (--tp): tensor parallelism runs the built-in GPT and "
                f"the Hugging Face families {', '.join(_TENSOR_PARALLEL_FAMILIES)}; "
                f"model.family {model.family!r} is not cut over tp"]
    dims = (("heads", model.heads, "--heads"), ("kv_heads", model.num_kv_heads, "--kv-heads"),
            ("ffn_hidden", model.ffn, "--ffn-hidden"), ("vocab", model.vocab, "--vocab"))
    if model.experts:
        dims += (("moe_ffn_hidden", model.moe_ffn, "each expert's MLP width"),)
    if model.experts and model.shared_expert_ffn_hidden:
        dims += (("shared_expert_ffn_hidden", model.shared_expert_ffn_hidden,
                  "the shared expert's MLP width"),)
    for name, value, flag in dims:
        if value % tp:
            out.append(f"model.{name} = {value} ({flag}) is not a multiple of tp = {tp}: "
                       "a tensor-parallel layer cuts it into tp equal parts")
    if par.sequence_parallel and model.seq_length % tp:
        out.append(f"model.seq_length = {model.seq_length} (--seq-len) is not a multiple of tp = "
                   f"{tp}: sequence parallelism cuts each sequence into tp chunks")
    return out
