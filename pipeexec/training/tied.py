"""Parameters tied across stages and pipeline ranks.

Some parameters exist more than once in a pipeline: a language model's output layer that reuses
the input embedding (Megatron-LM's default; GPT-2's ``tie_word_embeddings``), whose first and
last stages usually sit on different ranks, or a schedule that holds two copies of a model part
(DeepSeek's bidirectional DualPipe). Each instance is its own ``nn.Parameter`` on the rank that
holds its stage; they stay one parameter by three rules, Megatron's for its shared embedding:

* the same initial value: every instance is copied from the source (below) before training;
* after the backward, every instance's gradient is replaced by the sum over all instances
  (locally, then one all-reduce over the ranks that hold one), so every instance takes the
  same optimizer step;
* one instance, the source (the canonically named one on the lowest pipeline rank holding
  it), gives all the others their initial value and alone counts in the global gradient norm
  (`duplicate_sq`).

An instance is named by its global parameter name; a model maps an alias to the name it is an
alias of (`LayerStack.tied`), and two stages of the same model part hold the same names. A
canonical name with more than one instance anywhere in the pipeline is tied. Which ranks hold
which names is exchanged once at start-up (`all_gather_object`), so the rule needs no
knowledge of partitions or schedules.
"""
from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TiedSet:
    """One tied parameter: its canonical name, per pipeline rank holding an instance how many
    it holds (ascending ranks), and the ``source`` rank: the lowest holding an instance under
    the canonical name itself (else the lowest holder). The source's instance gives every
    instance its initial value and is the one that counts in the gradient norm."""

    name: str
    holders: tuple[tuple[int, int], ...]          # (pp rank, instances there)
    source: int

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(r for r, _ in self.holders)


def find_tied(names_by_rank: Mapping[int, Sequence[tuple[str, str]]]) -> list[TiedSet]:
    """The tied sets of a pipeline whose pipeline rank ``r`` holds parameters named
    ``names_by_rank[r]``: (own name, canonical name) per parameter. Sorted by name."""
    counts: dict[str, dict[int, int]] = {}
    canonical_at: dict[str, int] = {}
    for rank in sorted(names_by_rank):
        for own, name in names_by_rank[rank]:
            per_rank = counts.setdefault(name, {})
            per_rank[rank] = per_rank.get(rank, 0) + 1
            if own == name:
                canonical_at.setdefault(name, rank)
    return [TiedSet(name, tuple(sorted(per_rank.items())), canonical_at.get(name, min(per_rank)))
            for name, per_rank in sorted(counts.items()) if sum(per_rank.values()) > 1]


class TiedParameters:
    """This rank's instances of tied parameters: `copy_from_source` once before training,
    `reduce` gradients after every backward, `duplicate_sq` for the norm.

    ``instances``: (own name, canonical name, parameter, gradient tensor) for every parameter
    of this rank, in stage order; gradients are updated in place (views of the gradient
    buffer). ``groups``: for every tuple of pipeline ranks sharing a tied set this rank is in,
    the process group over them (this replica's ranks); ``global_rank``: pp rank -> global rank
    in this replica, for the value broadcast.
    """

    def __init__(self, instances: Sequence[tuple[str, str, torch.Tensor, torch.Tensor]],
                 tied: Sequence[TiedSet], pp_rank: int,
                 groups: Mapping[tuple[int, ...], object | None] | None = None,
                 global_rank=None, timeout: float | None = None) -> None:
        mine: dict[str, list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
        for own, name, param, grad in instances:
            mine.setdefault(name, []).append((own, param, grad))
        self.pp_rank = pp_rank
        self.sets = [t for t in tied if pp_rank in t.ranks]
        for t in self.sets:
            want = dict(t.holders)[pp_rank]
            if len(mine.get(t.name, ())) != want:
                raise ValueError(f"pp rank {pp_rank}: tied parameter {t.name!r} has "
                                 f"{len(mine.get(t.name, ()))} instances here, the pipeline "
                                 f"says {want}")
            mine[t.name].sort(key=lambda e, n=t.name: e[0] != n)
        self._inst = {t.name: mine[t.name] for t in self.sets}
        self._by_ranks: dict[tuple[int, ...], list[TiedSet]] = {}
        for t in self.sets:
            self._by_ranks.setdefault(t.ranks, []).append(t)
        groups = dict(groups or {})
        missing = [r for r in self._by_ranks if len(r) > 1 and groups.get(r) is None]
        if missing:
            raise ValueError(f"pp rank {pp_rank}: no process group for the tied parameters "
                             f"shared by pp ranks {missing[0]}")
        self._groups = groups
        self._global_rank = global_rank
        self._set_duplicates()
        self.timeout = timeout

    def _set_duplicates(self) -> None:
        dup = [e for t in self.sets
               for e in self._inst[t.name][(1 if t.source == self.pp_rank else 0):]]
        self._duplicates = [e[2] for e in dup]
        self._duplicate_params = [e[1] for e in dup]

    def __bool__(self) -> bool:
        return bool(self.sets)

    def _wait(self, work) -> None:
        if self.timeout is None:
            work.wait()
        else:
            work.wait(datetime.timedelta(seconds=self.timeout))

    @torch.no_grad()
    def copy_from_source(self) -> None:
        """Every instance := the source instance's value (collective over each set's group)."""
        for ranks, sets in self._by_ranks.items():
            values = [self._inst[t.name][0][1].detach() for t in sets]
            if len(ranks) > 1:
                for t, value in zip(sets, values):
                    self._wait(dist.broadcast(value, src=self._global_rank(t.source),
                                              group=self._groups[ranks], async_op=True))
            for t, value in zip(sets, values):
                for _, param, _ in self._inst[t.name][1:]:
                    param.copy_(value)

    @torch.no_grad()
    def reduce(self) -> None:
        """Every instance's gradient := the sum over all instances of its set."""
        pending = []
        for ranks, sets in self._by_ranks.items():
            sums = [torch.stack([e[2] for e in self._inst[t.name]]).sum(0) for t in sets]
            if len(ranks) > 1:
                flat = torch.cat([g.reshape(-1) for g in sums])
                pending.append((sets, sums, flat, dist.all_reduce(
                    flat, group=self._groups[ranks], async_op=True)))
            else:
                self._write(sets, sums)
        for sets, sums, flat, work in pending:
            self._wait(work)
            offset = 0
            for g in sums:
                g.copy_(flat[offset: offset + g.numel()].view(g.shape))
                offset += g.numel()
            self._write(sets, sums)

    def _write(self, sets: Sequence[TiedSet], sums: Sequence[torch.Tensor]) -> None:
        for t, total in zip(sets, sums):
            for _, _, grad in self._inst[t.name]:
                grad.copy_(total)

    def params(self) -> list[torch.Tensor]:
        """This rank's instances of tied parameters (every set it is in)."""
        return [e[1] for t in self.sets for e in self._inst[t.name]]

    def duplicate_params(self) -> list[torch.Tensor]:
        """This rank's instances that must not count in the norm (all but the source's)."""
        return list(self._duplicate_params)

    def bind_grads(self, grad_of) -> None:
        """Reduce the gradients ``grad_of(param)`` from now on (a tensor per instance, updated
        in place): for a holder whose gradient buffer comes to exist only after the tied sets
        are known (ZeRO-2/3 keep tied gradients in a buffer of their own)."""
        for t in self.sets:
            self._inst[t.name] = [(own, param, grad_of(param))
                                  for own, param, _ in self._inst[t.name]]
        self._set_duplicates()

    def duplicate_sq(self) -> torch.Tensor | None:
        """Sum of squares of this rank's instances that must not count in the norm."""
        if not self._duplicates:
            return None
        return sum(torch.dot(g.reshape(-1), g.reshape(-1)) for g in self._duplicates)


def tied_parameters(instances: Sequence[tuple[str, str, torch.Tensor, torch.Tensor]], *,
                    pp_rank: int, dp_rank: int, dp: int, rank_of,
                    timeout: float | None = None) -> TiedParameters:
    """Find this pipeline's tied parameters and build their process groups.

    Collective over the default group when it spans more than one process: every rank calls
    it at the same point (the Trainer's construction). ``rank_of(pp_rank, dp_rank)`` is the
    global rank of that position. Every replica must hold the same names per pipeline rank.
    """
    names = [(own, name) for own, name, _, _ in instances]
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return TiedParameters(instances, find_tied({pp_rank: names}), pp_rank, timeout=timeout)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (pp_rank, dp_rank, names))
    by_replica: dict[int, dict[int, list]] = {}
    for p, d, ns in gathered:
        by_replica.setdefault(d, {})[p] = [tuple(x) for x in ns]
    reference = by_replica[0]
    for d, table in by_replica.items():
        if table != reference:
            raise ValueError(f"dp replica {d} holds different parameter names per pipeline rank "
                             "than replica 0: the replicas must be built alike")
    tied = find_tied(reference)
    td = None if timeout is None else datetime.timedelta(seconds=timeout)
    groups: dict[tuple[int, ...], object] = {}
    # Every process creates every group, in the same order (torch.distributed's rule).
    for ranks in sorted({t.ranks for t in tied if len(t.ranks) > 1}):
        for d in range(dp):
            members = [rank_of(p, d) for p in ranks]
            group = dist.new_group(members, timeout=td) if td else dist.new_group(members)
            if d == dp_rank and pp_rank in ranks:
                groups[ranks] = group
    return TiedParameters(instances, tied, pp_rank, groups,
                          global_rank=lambda p: rank_of(p, dp_rank), timeout=timeout)
