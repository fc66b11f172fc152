"""How a tensor-parallel parameter is cut from its full tensor, and put back together.

Every parameter is initialised whole (from its layer's generator, as in one process) and then
cut, so a run is the same model whatever its tp; a checkpoint stores each rank's shard with its
`ShardSpec` and the loader reassembles the full tensor to cut it for the new tp.

``ShardSpec(dim, groups)``: the tensor along ``dim`` is ``groups`` equal blocks (a fused QKV
weight: 3 blocks, q, k and v), each block is cut into ``size`` contiguous pieces, and rank r
holds piece r of every block, concatenated. ``groups = 1`` is a plain contiguous split
(Megatron's column-parallel rows, row-parallel columns, vocab-parallel rows).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

ATTR = "tensor_parallel_shard"      # the ShardSpec a sharded parameter carries
SEQUENCE_PARALLEL_ATTR = "sequence_parallel"   # replicated, but sees one sequence chunk a rank


@dataclass(frozen=True)
class ShardSpec:
    dim: int
    groups: int = 1

    def to_dict(self) -> dict:
        return {"dim": self.dim, "groups": self.groups}

    @classmethod
    def from_dict(cls, d: dict) -> "ShardSpec":
        return cls(int(d["dim"]), int(d.get("groups", 1)))


def shard(full: torch.Tensor, spec: ShardSpec, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s piece of ``full`` (a new contiguous tensor)."""
    n = full.shape[spec.dim]
    if n % (spec.groups * size):
        raise ValueError(f"cannot cut dimension {spec.dim} of size {n} into {spec.groups} "
                         f"block(s) x {size} tensor-parallel pieces")
    blocks = full.chunk(spec.groups, dim=spec.dim)
    return torch.cat([b.chunk(size, dim=spec.dim)[rank] for b in blocks], dim=spec.dim).contiguous()


def unshard(pieces: list[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """The full tensor from every rank's piece, in rank order (inverse of `shard`)."""
    per_rank = [p.chunk(spec.groups, dim=spec.dim) for p in pieces]
    return torch.cat([torch.cat([pr[g] for pr in per_rank], dim=spec.dim)
                      for g in range(spec.groups)], dim=spec.dim)


def shard_spec(param: torch.Tensor) -> ShardSpec | None:
    """The ShardSpec of a tensor-parallel parameter (None: replicated on every tp rank)."""
    return getattr(param, ATTR, None)


def mark(param: torch.Tensor, spec: ShardSpec | None = None, *,
         sequence_parallel: bool = False) -> torch.Tensor:
    """Tag ``param``: sharded as ``spec``, or replicated but fed one sequence chunk per rank
    (its gradient is then summed over the tensor-parallel group after the backward)."""
    if spec is not None:
        setattr(param, ATTR, spec)
    if sequence_parallel:
        setattr(param, SEQUENCE_PARALLEL_ATTR, True)
    return param


def is_sequence_parallel(param: torch.Tensor) -> bool:
    return bool(getattr(param, SEQUENCE_PARALLEL_ATTR, False))
