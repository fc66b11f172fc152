"""`Stage`: the layers of one pipeline stage, keyed by their global layer index.

Parameter names are ``layers.<global index>.<name>`` whatever the layout, so state dicts and
optimizer state can be saved from one layout and loaded into another.
"""
from __future__ import annotations

import torch
from torch import nn

from ..model import ModelSpec


class Stage(nn.Module):
    def __init__(self, index: int, layer_ids: range, layers: list[nn.Module], *, is_first: bool,
                 is_last: bool) -> None:
        super().__init__()
        self.index = index
        self.layer_ids = layer_ids
        self.layers = nn.ModuleDict({str(i): layer for i, layer in zip(layer_ids, layers)})
        self.is_first, self.is_last = is_first, is_last
        self._seq = list(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self._seq:
            x = layer(x)
        return x


def build_stage(spec: ModelSpec, index: int, bounds: tuple[int, ...], *, seed: int,
                device: torch.device, dtype: torch.dtype) -> Stage:
    """Materialise only the layers of stage ``index`` (initialised from (seed, layer index))."""
    ids = range(bounds[index], bounds[index + 1])
    layers = [spec.build_layer(i, seed, device=device, dtype=dtype) for i in ids]
    return Stage(index, ids, layers, is_first=index == 0, is_last=index == len(bounds) - 2)
