"""Expert parallelism for the Hugging Face MoE layers of `hf` (Mixtral; the Qwen MoE families
the same way once `hf.FAMILIES` has them): each decoder layer is built whole (initialised or
loaded, then tp-cut), then its experts module is cut to this rank's ``E / ep`` experts
(experts ``ep_rank E/ep ...``) and replaced by `ExpertParallelExperts`, which dispatches the
tokens to the experts' owners and combines their outputs (`pipeexec.parallel.experts`).

The MoE block's own forward, its router (replicated, on this rank's tokens) and a shared
expert (Qwen2-MoE) stay Hugging Face's; the experts keep their parameter names
(``...mlp.experts.gate_up_proj`` / ``down_proj``), so `hf.hf_name` and checkpoints read the same
names, their first dimension the local experts. Each is marked `expert_parallel` (its dim 0
cut into ep contiguous pieces; `is_expert` finds it), so the trainer reduces its gradient over
the expert-data-parallel group and a checkpoint stores it as an ep shard.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from ..parallel.experts import ExpertParallel, expert_parallel_moe, local_experts

ATTR = "expert_parallel"        # on an expert parameter: its dim 0 is this rank's experts

# families whose decoder layers hold ``block.mlp.experts`` with HF's fused 3-d expert tensors
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")


def is_expert(param: torch.Tensor) -> bool:
    """Whether ``param`` holds this rank's experts (cut over ep along dim 0)."""
    return bool(getattr(param, ATTR, False))


def mark_expert(param: torch.Tensor) -> torch.Tensor:
    setattr(param, ATTR, True)
    return param


class ExpertParallelExperts(nn.Module):
    """A Hugging Face fused experts module (``gate_up_proj`` (E, 2f, h), ``down_proj``
    (E, h, f)) holding only this rank's experts; called as HF's, ``(hidden, top_k_index,
    top_k_weights) -> hidden``, over every expert of the layer."""

    def __init__(self, full: nn.Module, ep: ExpertParallel) -> None:
        super().__init__()
        self.ep = ep
        self.num_experts = full.num_experts
        mine = local_experts(full.num_experts, ep)
        self.local = mine                   # the global indices of its experts
        self.hidden_dim = getattr(full, "hidden_dim", full.gate_up_proj.shape[-1])
        self.intermediate_dim = getattr(full, "intermediate_dim", full.down_proj.shape[-1])
        self.act_fn = full.act_fn
        for name in ("gate_up_proj", "down_proj"):
            old = getattr(full, name)
            new = nn.Parameter(old.detach()[mine.start: mine.stop].clone())
            new.__dict__.update({k: v for k, v in old.__dict__.items() if k != ATTR})  # tp's spec
            setattr(self, name, mark_expert(new))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return expert_parallel_moe(hidden_states, top_k_index, top_k_weights, self.gate_up_proj,
                                   self.down_proj, self.act_fn, self.num_experts, self.ep)


def ep_decoder_layer(layer: nn.Module, model_type: str, ep: ExpertParallel) -> nn.Module:
    """`hf.HFDecoderLayer`, its experts cut to this rank's (after any tp cut)."""
    if model_type not in MOE_FAMILIES:
        raise ValueError(f"expert parallelism: model_type {model_type!r} has no experts "
                         f"(MoE families: {', '.join(MOE_FAMILIES)})")
    mlp = layer.block.mlp
    experts = getattr(mlp, "experts", None)
    if experts is None or not hasattr(experts, "gate_up_proj"):
        return layer        # a dense layer of a MoE model (Qwen2-MoE's mlp_only_layers)
    mlp.experts = ExpertParallelExperts(experts, ep)
    layer.ep = ep
    return layer


def expert_parallel_stack(stack: Any, model_type: str, ep: ExpertParallel) -> Any:
    """``stack`` (a `LayerStack` of `hf`: embedding, blocks, head) whose decoder layers come
    out with their experts cut over ``ep``."""
    if not ep.active:
        return stack
    factory, last = stack.factory, stack.num_layers - 1

    def cut(index: int, gen: torch.Generator) -> nn.Module:
        layer = factory(index, gen)
        return layer if index in (0, last) else ep_decoder_layer(layer, model_type, ep)

    return dataclasses.replace(stack, factory=cut)
