"""`Stage`: the layers of one pipeline stage, keyed by their global layer index.

Parameter names are ``layers.<global index>.<name>`` whatever the layout, so state dicts and
optimizer state can be saved from one layout and loaded into another.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..model import LayerStack


class Stage(nn.Module):
    def __init__(self, index: int, layer_ids: range, layers: list[nn.Module], *, is_first: bool,
                 is_last: bool) -> None:
        super().__init__()
        self.index = index
        self.layer_ids = layer_ids
        self.layers = nn.ModuleDict({str(i): layer for i, layer in zip(layer_ids, layers)})
        self.is_first, self.is_last = is_first, is_last
        self._seq = list(layers)
        self._recomputed: frozenset[int] = frozenset()     # positions in _seq

    def set_recompute(self, mode: str, kinds: tuple[str, ...], num_layers: int | None = None
                      ) -> None:
        """Activation recomputation (``kinds``: this stage's layer kinds). ``full``: the first
        ``num_layers`` (default all) layers that are not the embedding or the head run under
        ``torch.utils.checkpoint`` (each keeps only its input; its forward is redone in the
        backward). ``selective``: layers with a ``recompute_core_attention`` switch (the
        built-in GPT's blocks) recompute their core attention. ``none``: keep everything."""
        body = [k for k, kind in enumerate(kinds) if kind not in ("embedding", "head")]
        full = body if num_layers is None else body[:num_layers]
        self._recomputed = frozenset(full) if mode == "full" else frozenset()
        for layer in self._seq:
            if hasattr(layer, "recompute_core_attention"):
                layer.recompute_core_attention = mode == "selective"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        recompute = self._recomputed and torch.is_grad_enabled()
        for k, layer in enumerate(self._seq):
            if recompute and k in self._recomputed:
                x = checkpoint(layer, x, use_reentrant=False)
            else:
                x = layer(x)
        return x


def build_stage(spec: LayerStack, index: int, bounds: tuple[int, ...], *, seed: int,
                device: torch.device, dtype: torch.dtype) -> Stage:
    """Materialise only the layers of stage ``index`` (initialised from (seed, layer index))."""
    ids = range(bounds[index], bounds[index + 1])
    layers = [spec.build_layer(i, seed, device=device, dtype=dtype) for i in ids]
    return Stage(index, ids, layers, is_first=index == 0, is_last=index == len(bounds) - 2)
