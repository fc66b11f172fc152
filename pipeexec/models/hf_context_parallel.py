"""Context parallelism for the Hugging Face layers of `hf`: each layer keeps the family's own
modules and forward code; what changes is where its tokens sit and what its attention sees.

* Embedding: the token ids are this cp rank's two chunks of the sequence
  (`pipeexec.parallel.context`); GPT-2's learned positions are those tokens' global positions.
* Decoder layer: its rotary position ids are the global positions of its tokens (`hf.
  HFDecoderLayer` makes them), it makes no mask, and its attention module reads a config copy
  naming an attention implementation registered here through transformers' public extension
  point (`AttentionInterface.register`): the family's own implementation (``sdpa`` or its
  ``eager``) run by `context.context_parallel_attention` on the local queries against the
  keys and values all-gathered from every cp rank (GQA: gathered at the kv heads' width), with
  the causal mask, and a sliding layer's window, at the global positions, in the format that
  implementation reads (bool for SDPA, additive for eager). Its backward recomputes it.
* Head: nothing (the loss is each rank's mean over its tokens; the trainer averages over cp).
"""
from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from ..parallel import context
from ..parallel.context import ContextParallel
from .hf_config import HFModelError

# the attention implementations a context-parallel layer can run, and the mask each reads
_MASKS = ("sdpa", "eager")


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min)


def attention_name(model_type: str, base: str, eager: Callable) -> str:
    """The name of the context-parallel attention over ``base`` (registered on first use);
    ``eager``: the family's ``eager_attention_forward``."""
    import transformers

    if base not in _MASKS:
        raise HFModelError(f"context parallelism runs the attention implementations "
                           f"{', '.join(_MASKS)}; this model's is {base!r}")
    name = f"pipeexec-cp-{model_type}-{base}"
    interface = transformers.AttentionInterface
    known = interface()
    if name in known.valid_keys():
        return name
    base_fn = eager if base == "eager" else known[base]

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                  **kwargs):
        if dropout:
            raise HFModelError("context parallelism recomputes the attention in its backward: "
                               "attention dropout would draw another mask (set it to 0)")

        def attend(q, k, v, allowed):
            allowed = allowed[None, None]
            mask = allowed if base == "sdpa" else _additive(allowed, q.dtype)
            return base_fn(module, q, k, v, mask, dropout=0.0, scaling=scaling, **kwargs)[0]

        out = context.context_parallel_attention(query, key, value, module.context_parallel,
                                                 attend, window=module.context_window)
        return out, None

    interface.register(name, attention)
    return name


def cp_embedding(layer: nn.Module, cp: ContextParallel) -> nn.Module:
    """`hf.HFEmbedding` under context parallelism (GPT-2's positions: the global ones)."""
    layer.cp = cp
    return layer


def cp_decoder_layer(layer: nn.Module, model_type: str, cp: ContextParallel,
                     eager: Callable) -> nn.Module:
    """`hf.HFDecoderLayer` (cut over tp or not) under context parallelism: its attention reads
    a config copy naming the context-parallel implementation of the layer's own (``eager``:
    the family's ``eager_attention_forward``)."""
    attention = layer.attention_module()
    local = copy.copy(attention.config)
    local._attn_implementation = attention_name(model_type, layer.config._attn_implementation,
                                                eager)
    attention.config = local
    attention.context_parallel = cp
    attention.context_window = layer.config.sliding_window if layer.sliding else None
    layer.cp = cp
    return layer
