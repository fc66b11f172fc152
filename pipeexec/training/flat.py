"""Where each parameter of a stage sits in the stage's flat buffer, and how that buffer is cut
into data-parallel shards: the index arithmetic of the ZeRO holder (`pipeexec.training.zero`),
torch-free.

A stage's parameters lie end to end in one flat buffer, in ``stage.parameters()`` order (the
order the runtime hands gradients over in), grouped into buckets: one per layer of the stage
(``layers.<i>.*``), each padded at its end to a multiple of the number of shards ``d``. Every
bucket is cut into ``d`` contiguous slices and shard ``r`` is the concatenation of slice ``r``
of every bucket (Megatron-LM's distributed optimizer cuts each of its buckets the same way), so
a bucket's gradients are reduce-scattered and its weights all-gathered on their own, as soon
as the backward has made them. A parameter may straddle two slices: the part of it in one
rank's shard is a `Piece`, and the pieces of a shard are what that rank's optimizer steps.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Slot:
    """One parameter's place in its stage's flat buffer."""

    name: str                     # global parameter name (layers.<i>.<name>)
    index: int                    # position in the stage's parameter list
    start: int                    # first element in the stage's flat buffer
    numel: int
    shape: tuple[int, ...]
    decay: bool                   # takes weight decay (2-d and larger; biases and norms do not)
    bucket: int                   # the bucket (layer) it belongs to

    @property
    def stop(self) -> int:
        return self.start + self.numel


@dataclass(frozen=True)
class Bucket:
    """A run of the flat buffer reduced and gathered on its own: ``[start, start + padded)``,
    whose slice ``r`` is ``[start + r * slice, start + (r + 1) * slice)`` and lies at
    ``shard_start`` in every rank's shard."""

    start: int
    numel: int                    # elements of its parameters
    padded: int                   # numel rounded up to a multiple of the shards
    slice: int                    # padded / shards
    shard_start: int
    params: int                   # how many parameters it holds

    def mine(self, rank: int) -> tuple[int, int]:
        """This rank's slice of the bucket, in flat-buffer positions."""
        lo = self.start + rank * self.slice
        return lo, lo + self.slice


@dataclass(frozen=True)
class Piece:
    """The part ``[lo, hi)`` (in the parameter's own flat numbering) of ``slot`` that lies in
    this rank's shard: at ``offset`` in the shard, at ``slot.start + lo`` in the flat buffer."""

    slot: Slot
    lo: int
    hi: int
    offset: int

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    @property
    def flat(self) -> int:
        return self.slot.start + self.lo


def layer_of(name: str) -> str:
    """The bucket key of a parameter: its layer (``layers.<i>``), else its whole name."""
    parts = name.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 and parts[0] == "layers" else name


@dataclass(frozen=True)
class StageLayout:
    """The flat buffer of one stage cut into ``shards`` shards, seen from shard ``rank``."""

    stage: int
    slots: tuple[Slot, ...]
    buckets: tuple[Bucket, ...]
    shards: int
    rank: int

    @classmethod
    def of(cls, stage: int, params: Sequence[tuple[str, tuple[int, ...]]], shards: int,
           rank: int) -> "StageLayout":
        """``params``: (global name, shape) of each parameter, in the stage's order; the
        parameters of one layer must be adjacent (a stage's modules are, layer by layer)."""
        if shards < 1 or not 0 <= rank < shards:
            raise ValueError(f"shard {rank} of {shards}")
        groups: list[list[tuple[int, str, tuple[int, ...]]]] = []
        keys: list[str] = []
        for k, (name, shape) in enumerate(params):
            key = layer_of(name)
            if not keys or keys[-1] != key:
                if key in keys:
                    raise ValueError(f"stage {stage}: the parameters of {key} are not adjacent")
                keys.append(key)
                groups.append([])
            groups[-1].append((k, name, tuple(shape)))
        slots, buckets, start, shard_start = [], [], 0, 0
        for b, group in enumerate(groups):
            offset = start
            for k, name, shape in group:
                n = math.prod(shape)
                slots.append(Slot(name, k, offset, n, shape, len(shape) >= 2, b))
                offset += n
            numel = offset - start
            padded = -(-numel // shards) * shards
            buckets.append(Bucket(start, numel, padded, padded // shards, shard_start, len(group)))
            start += padded
            shard_start += padded // shards
        return cls(stage, tuple(slots), tuple(buckets), shards, rank)

    @property
    def padded(self) -> int:
        """The flat buffer's length (every bucket padded)."""
        return sum(b.padded for b in self.buckets)

    @property
    def shard_numel(self) -> int:
        return sum(b.slice for b in self.buckets)

    def pieces(self) -> tuple[Piece, ...]:
        """The parts of parameters inside this rank's shard, in shard order."""
        out = []
        for slot in self.slots:
            bucket = self.buckets[slot.bucket]
            lo, hi = bucket.mine(self.rank)
            a, b = max(slot.start, lo), min(slot.stop, hi)
            if a < b:
                out.append(Piece(slot, a - slot.start, b - slot.start,
                                 bucket.shard_start + a - lo))
        return tuple(out)


def runs(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` ``[a, b)`` (ascending), adjacent ones merged: one dot product per run, not
    per parameter, for the gradient norm."""
    out: list[list[int]] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1][1] = b
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]
