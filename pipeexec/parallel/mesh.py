"""`Mesh`: where each global rank sits in the plan's device mesh, and the members of every
group. Torch-free, so the layout is checked (and tested against pipesim) before any process.

Ranks are numbered as Megatron-LM's ``RankGenerator`` numbers them with order "tp-cp-dp-pp"
(and as `pipesim.plan.Cluster` places them on GPUs): tensor-parallel ranks fastest, then
context, data and pipeline parallel::

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

so a tensor-parallel group is ``tp`` consecutive ranks (one NVLink domain when it fits), one
pipeline is the ranks of one (tp, cp, dp) position at stride ``tp * cp * dp``, and the gradient
group of the dense parameters is data x context parallel (Megatron's ``dp_cp`` group: with
context parallelism each of those ranks saw a different part of the same sequences).
With tp = cp = 1 the numbering is the older ``pp_rank * dp + dp_rank``.

Expert parallelism is carved out of data x context parallel, as Megatron's expert
``RankGenerator`` does (order "tp-ep-dp-pp" over the same ranks, expert tp = tp): the dp x cp
index ``j = dp_rank * cp + cp_rank`` of a rank splits into ``ep_rank = j % ep`` and its
expert-data-parallel rank ``j // ep``, so::

    rank = ((pp_rank * (dp * cp / ep) + edp_rank) * ep + ep_rank) * tp + tp_rank

An expert-parallel group is ``ep`` ranks of one dp x cp group, consecutive in dp x cp order
(stride ``tp`` in global ranks, one tp rank: tp-cut experts are dispatched among ranks of the
same tp rank); the expert-data-parallel group is the ``dp * cp / ep`` ranks that hold the same
experts (the gradient group of the expert parameters). Every member of both is at the same
pipeline position, so they run the same actions in the same order.
"""
from __future__ import annotations

from dataclasses import dataclass

DIMS = ("tp", "cp", "dp", "pp")      # fastest first


@dataclass(frozen=True)
class Coords:
    tp: int
    cp: int
    dp: int
    pp: int


@dataclass(frozen=True)
class ExpertCoords:
    tp: int
    ep: int
    edp: int                      # expert-data-parallel rank
    pp: int


@dataclass(frozen=True)
class Mesh:
    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "cp", "dp", "pp", "ep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"mesh: {name} must be a positive integer, got {value!r}")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"mesh: ep = {self.ep} must divide dp * cp = {self.dp} * {self.cp} = "
                             f"{self.dp * self.cp}: expert parallelism is carved out of data x "
                             "context parallelism (Megatron's expert layout)")

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def rank(self, *, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """The global rank at these coordinates."""
        for name, value in (("tp", tp), ("cp", cp), ("dp", dp), ("pp", pp)):
            if not 0 <= value < getattr(self, name):
                raise ValueError(f"mesh: {name} rank {value} outside 0..{getattr(self, name) - 1}")
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"mesh: rank {rank} outside 0..{self.world_size - 1} "
                             f"(tp {self.tp} x cp {self.cp} x dp {self.dp} x pp {self.pp})")
        rest, tp = divmod(rank, self.tp)
        rest, cp = divmod(rest, self.cp)
        pp, dp = divmod(rest, self.dp)
        return Coords(tp, cp, dp, pp)

    def group(self, dims: str | tuple[str, ...], rank: int) -> tuple[int, ...]:
        """The ranks that share every coordinate of ``rank`` except those in ``dims`` (e.g.
        ``"tp"``: its tensor-parallel group; ``("dp", "cp")``: its gradient group), ordered by
        their coordinates along ``dims`` (the first dim fastest)."""
        dims = (dims,) if isinstance(dims, str) else tuple(dims)
        unknown = [d for d in dims if d not in DIMS]
        if unknown:
            raise ValueError(f"mesh: unknown dimension {unknown[0]!r}: one of {', '.join(DIMS)}")
        here = self.coords(rank).__dict__
        members: list[int] = []
        ordered = sorted(dims, key=DIMS.index)
        sizes = [getattr(self, d) for d in ordered]

        def walk(k: int, at: dict) -> None:
            if k < 0:
                members.append(self.rank(**at))
                return
            for v in range(sizes[k]):
                walk(k - 1, {**at, ordered[k]: v})
        walk(len(ordered) - 1, dict(here))
        return tuple(members)

    def groups(self, dims: str | tuple[str, ...]) -> list[tuple[int, ...]]:
        """Every group along ``dims``, each once, in the order of their lowest rank: the order
        every rank must create them in (a torch.distributed requirement)."""
        seen: dict[tuple[int, ...], None] = {}
        for r in range(self.world_size):
            seen.setdefault(self.group(dims, r), None)
        return list(seen)

    # -- the expert layout (tp-ep-edp-pp) -------------------------------------------------
    @property
    def edp(self) -> int:
        """The expert-data-parallel size: ranks holding the same experts (dp * cp / ep)."""
        return self.dp * self.cp // self.ep

    def expert_coords(self, rank: int) -> ExpertCoords:
        """Where ``rank`` sits in the expert layout."""
        c = self.coords(rank)
        edp, ep = divmod(c.dp * self.cp + c.cp, self.ep)
        return ExpertCoords(c.tp, ep, edp, c.pp)

    def expert_rank(self, *, tp: int = 0, ep: int = 0, edp: int = 0, pp: int = 0) -> int:
        """The global rank at these expert-layout coordinates."""
        for name, value, size in (("tp", tp, self.tp), ("ep", ep, self.ep),
                                  ("edp", edp, self.edp), ("pp", pp, self.pp)):
            if not 0 <= value < size:
                raise ValueError(f"mesh: {name} rank {value} outside 0..{size - 1}")
        return ((pp * self.edp + edp) * self.ep + ep) * self.tp + tp

    def ep_group(self, rank: int) -> tuple[int, ...]:
        """The expert-parallel group of ``rank``, by ep rank."""
        c = self.expert_coords(rank)
        return tuple(self.expert_rank(tp=c.tp, ep=e, edp=c.edp, pp=c.pp) for e in range(self.ep))

    def edp_group(self, rank: int) -> tuple[int, ...]:
        """The expert-data-parallel group of ``rank`` (same experts), by edp rank."""
        c = self.expert_coords(rank)
        return tuple(self.expert_rank(tp=c.tp, ep=c.ep, edp=d, pp=c.pp) for d in range(self.edp))

    def ep_groups(self) -> list[tuple[int, ...]]:
        """Every expert-parallel group, in the order of their lowest rank (creation order)."""
        return list(dict.fromkeys(self.ep_group(r) for r in range(self.world_size)))

    def edp_groups(self) -> list[tuple[int, ...]]:
        """Every expert-data-parallel group, in the order of their lowest rank."""
        return list(dict.fromkeys(self.edp_group(r) for r in range(self.world_size)))

    def __str__(self) -> str:
        ep = f" (ep {self.ep})" if self.ep > 1 else ""
        return f"tp {self.tp} x cp {self.cp} x dp {self.dp} x pp {self.pp}{ep}"
