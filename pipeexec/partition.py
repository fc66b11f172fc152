"""Cut an ordered layer list into ``num_stages`` contiguous stages.

A partition is a tuple of ``num_stages + 1`` layer indices: stage ``s`` holds layers
``bounds[s] .. bounds[s+1]-1``. Three ways to choose it: the plan's cut (default: its
transformer blocks per stage, `pipesim.Plan.stage_layers`, pipesim's one even split unless the
plan gives its own, with the embedding on the first stage and the head on the last), balanced
parameter counts (the contiguous split minimising the largest stage, by dynamic programming),
or explicit boundaries. A plain layer list (no embedding and head) is cut by the same even
split (`by_layers`).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pipesim.errors import PlanError
from pipesim.plan.partition import even_split


class PartitionError(ValueError):
    pass


def by_layers(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Equal counts of a plain layer list, the first ``num_layers % num_stages`` stages one
    more (`pipesim.plan.partition.even_split`)."""
    _check(num_layers, num_stages)
    return _bounds(even_split(num_layers, num_stages))


def from_blocks(blocks: Sequence[int]) -> tuple[int, ...]:
    """Bounds of [embedding, blocks..., head] holding ``blocks[s]`` transformer blocks on stage
    ``s``, the embedding on the first stage and the head on the last; PartitionError for a
    stage left empty."""
    sizes = [n + (s == 0) + (s == len(blocks) - 1) for s, n in enumerate(blocks)]
    if any(size < 1 for size in sizes):
        raise PartitionError(f"partition: blocks per stage {list(blocks)} leave stage "
                             f"{sizes.index(0)} empty (the first stage holds the embedding, the "
                             "last the head)")
    return _bounds(sizes)


def plan_bounds(plan: Any) -> tuple[int, ...]:
    """The bounds of ``plan``'s (a `pipesim.Plan`) model as a layer stack: its blocks per
    stage (`Plan.stage_layers`) with the embedding and the head."""
    try:
        blocks = plan.stage_layers()
    except PlanError as exc:
        raise PartitionError(str(exc)) from None
    return from_blocks(blocks)


def by_params(counts: Sequence[int], num_stages: int) -> tuple[int, ...]:
    """Contiguous split of ``counts`` into ``num_stages`` non-empty parts minimising the max sum."""
    n = len(counts)
    _check(n, num_stages)
    prefix = [0]
    for c in counts:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: minimal max-part for the first i layers in k parts; cut[k][i]: last cut.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i]:
                    best[k][i], cut[k][i] = v, j
    bounds = [n]
    i = n
    for k in range(num_stages, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    return tuple(reversed(bounds))


def explicit(boundaries: Sequence[int], num_layers: int, num_stages: int) -> tuple[int, ...]:
    """``boundaries``: the first layer of stages 1 .. num_stages-1, strictly increasing."""
    _check(num_layers, num_stages)
    inner = tuple(int(b) for b in boundaries)
    if len(inner) != num_stages - 1:
        raise PartitionError(f"explicit boundaries need {num_stages - 1} values for {num_stages} "
                             f"stages, got {len(inner)}: {inner}")
    bounds = (0, *inner, num_layers)
    for s in range(num_stages):
        if bounds[s] >= bounds[s + 1]:
            raise PartitionError(f"explicit boundaries {inner} leave stage {s} empty "
                                 f"(layers {bounds[s]}..{bounds[s + 1] - 1}) of {num_layers} layers")
    return bounds


def make_partition(num_layers: int, num_stages: int, method: str = "layers",
                   boundaries: Sequence[int] | None = None,
                   param_counts: Sequence[int] | None = None) -> tuple[int, ...]:
    if boundaries is not None:
        return explicit(boundaries, num_layers, num_stages)
    if method == "layers":
        return by_layers(num_layers, num_stages)
    if method == "params":
        if param_counts is None:
            raise PartitionError("partition by params needs the layers' parameter counts")
        return by_params(param_counts, num_stages)
    raise PartitionError(f"unknown partition method {method!r}: expected 'layers' or 'params'")


def stage_bounds(stack: Any, config: Any) -> tuple[int, ...]:
    """The bounds ``config`` (a `TrainConfig`: its plan, partition, boundaries) cuts ``stack``
    (a `LayerStack`: num_layers, blocks, layer_param_counts) into: the one place a run's
    partition is computed (the Trainer, and prediction before running). A stack of the plan's
    model is cut as the plan cuts it (`plan_bounds`)."""
    if (config.layout.boundaries is None and config.layout.partition == "layers"
            and stack.blocks is not None and stack.blocks == config.plan.model.layers):
        return plan_bounds(config.plan)
    counts = stack.layer_param_counts() if config.layout.partition == "params" else None
    return make_partition(stack.num_layers, config.num_stages, config.layout.partition,
                          config.layout.boundaries, counts)


def stage_layers(bounds: Sequence[int], stage: int) -> range:
    return range(bounds[stage], bounds[stage + 1])


def _bounds(sizes: Sequence[int]) -> tuple[int, ...]:
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return tuple(out)


def _check(num_layers: int, num_stages: int) -> None:
    if num_stages < 1:
        raise PartitionError(f"need at least one stage, got {num_stages}")
    if num_layers < num_stages:
        raise PartitionError(f"{num_layers} layers cannot fill {num_stages} stages "
                             "(every stage needs at least one layer)")
