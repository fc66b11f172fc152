"""`Schedule`: a training step as plain data, one ordered action list per pipeline rank."""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..errors import ScheduleError
from .action import ALL_OPS, COMM_OPS, COMPUTE_OPS, OVERLAP_F_B, Action, flat_parts
from .comms import insert_comms
from .placement import make_placement, placement_kind


class Schedule:
    """Per-rank ordered actions over ``num_stages = pp * vpp`` stages and ``num_microbatches``.

    Build it from per-rank lists of compute actions (communication is inserted by
    :func:`insert_comms`) or from full lists that already hold SEND/RECV actions (taken as they
    are, so hand-made schedules can be validated). ``placement`` is ``"looped"``, ``"v"`` or an
    explicit stage -> rank sequence. ``recv_lookahead`` is how many computations ahead of their
    consumer inserted receives are posted (see :mod:`pipesim.schedule.comms`). Equality
    compares the data (pp, vpp, microbatches, placement and actions), not the name.
    """

    __slots__ = ("name", "pp", "vpp", "num_microbatches", "placement", "forward_only",
                 "_orders", "_actions", "_rank_stages", "_validated", "_explicit_comms",
                 "recv_lookahead")

    def __init__(
        self,
        pp: int,
        vpp: int,
        num_microbatches: int,
        placement: str | Sequence[int],
        orders: Sequence[Iterable[Action]],
        *,
        name: str = "custom",
        forward_only: bool = False,
        recv_lookahead: int = 0,
    ) -> None:
        for field, value in (("pp", pp), ("vpp", vpp), ("microbatches", num_microbatches)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ScheduleError(f"{field} must be a positive integer, got {value!r}")
        if not isinstance(recv_lookahead, int) or isinstance(recv_lookahead, bool) or recv_lookahead < 0:
            raise ScheduleError(f"recv_lookahead must be a non-negative integer, got {recv_lookahead!r}")
        self.name = name
        self.recv_lookahead = recv_lookahead
        self.pp = pp
        self.vpp = vpp
        self.num_microbatches = num_microbatches
        self.forward_only = bool(forward_only)
        if isinstance(placement, str):
            self.placement = make_placement(placement, pp, vpp)
        else:
            self.placement = tuple(int(r) for r in placement)
        if len(self.placement) != pp * vpp:
            raise ScheduleError(
                f"placement has {len(self.placement)} stages, expected pp*vpp = {pp * vpp}")
        rank_stages: list[list[int]] = [[] for _ in range(pp)]
        for stage, rank in enumerate(self.placement):
            if not 0 <= rank < pp:
                raise ScheduleError(f"placement puts stage {stage} on rank {rank}, outside 0..{pp - 1}")
            rank_stages[rank].append(stage)
        for rank, stages in enumerate(rank_stages):
            if len(stages) != vpp:
                raise ScheduleError(
                    f"placement gives rank {rank} {len(stages)} stages {stages}, expected vpp = {vpp}")
        self._rank_stages = tuple(tuple(s) for s in rank_stages)

        orders = [tuple(o) for o in orders]
        if len(orders) != pp:
            raise ScheduleError(f"got action lists for {len(orders)} ranks, expected pp = {pp}")
        compute: list[tuple[Action, ...]] = []
        full: list[tuple[Action, ...] | None] = []
        for rank, order in enumerate(orders):
            has_comm = False
            for a in order:
                if not isinstance(a, Action):
                    raise ScheduleError(f"rank {rank}: {a!r} is not an Action")
                if a.op not in ALL_OPS:
                    raise ScheduleError(f"rank {rank}: action {a!r} has unknown op {a.op!r}")
                has_comm = has_comm or a.op in COMM_OPS
            if has_comm:
                compute.append(tuple(a for a in order if a.op in COMPUTE_OPS))
                full.append(order)
            else:
                compute.append(order)
                full.append(None)
        self._orders = tuple(compute)
        self._actions = full
        self._explicit_comms = any(a is not None for a in full)
        if self._explicit_comms and recv_lookahead:
            raise ScheduleError("recv_lookahead applies to inserted receives; this schedule's "
                                "SEND/RECV actions are given by hand")
        self._validated = False

    # -- shape ------------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return self.pp * self.vpp

    @property
    def placement_kind(self) -> str:
        """'looped', 'v' or 'custom'."""
        return placement_kind(self.placement, self.pp, self.vpp)

    def stage_rank(self, stage: int) -> int:
        """The rank that holds ``stage``."""
        return self.placement[stage]

    def rank_stages(self, rank: int) -> list[int]:
        """The stages held by ``rank``, ascending; a stage's position here is its chunk."""
        return list(self._rank_stages[rank])

    def stage_chunk(self, stage: int) -> int:
        """The index of ``stage`` among the stages of its rank."""
        return self._rank_stages[self.placement[stage]].index(stage)

    # -- actions ----------------------------------------------------------------------------
    def compute_order(self, rank: int) -> list[Action]:
        """F / B / I / W (and OVERLAP_F_B) actions of ``rank`` in execution order."""
        return list(self._orders[rank])

    def compute_parts(self, rank: int) -> list[Action]:
        """F / B / I / W of ``rank`` in execution order, each overlap split into its parts."""
        return flat_parts(self._orders[rank])

    @property
    def has_overlaps(self) -> bool:
        """True when some rank runs an overlapped forward-and-backward (``OVERLAP_F_B``)."""
        return any(a.op == OVERLAP_F_B for order in self._orders for a in order)

    def actions(self, rank: int) -> list[Action]:
        """All actions of ``rank`` in execution order, SEND/RECV included."""
        full = self._actions[rank]
        if full is None:
            full = tuple(insert_comms(self._orders[rank], rank, self.placement, self.recv_lookahead))
            self._actions[rank] = full
        return list(full)

    def with_recv_lookahead(self, lookahead: int) -> "Schedule":
        """The same schedule with its receives posted ``lookahead`` computations early."""
        if lookahead == self.recv_lookahead:
            return self
        return Schedule(self.pp, self.vpp, self.num_microbatches, self.placement, self._orders,
                        name=self.name, forward_only=self.forward_only, recv_lookahead=lookahead)

    @property
    def has_explicit_comms(self) -> bool:
        """True when the SEND/RECV actions were given by hand rather than inserted."""
        return self._explicit_comms

    @property
    def num_compute_actions(self) -> int:
        return sum(len(o) for o in self._orders)

    def validate(self, *, single_channel: bool = False) -> "Schedule":
        """Check ordering, send/receive matching and deadlock freedom; raise ScheduleError.

        ``single_channel``: also check that between every two ranks the receives are posted in
        the order of the sends, activations and gradients together, as
        torch.distributed.pipelining's runtime needs (see :mod:`pipesim.schedule.torch_order`).
        Returns the schedule itself, so ``build(...).validate()`` chains.
        """
        if not self._validated:
            from .validate import validate_schedule

            validate_schedule(self)
            self._validated = True
        if single_channel:
            from .torch_order import check_single_channel

            check_single_channel(self)
        return self

    # -- value semantics --------------------------------------------------------------------
    def _key(self) -> tuple:
        return (self.pp, self.vpp, self.num_microbatches, self.placement,
                tuple(tuple(self.actions(r)) for r in range(self.pp)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Schedule):
            return NotImplemented
        if (self.pp, self.vpp, self.num_microbatches, self.placement) != (
                other.pp, other.vpp, other.num_microbatches, other.placement):
            return False
        return self._orders == other._orders and self._key() == other._key()

    def __hash__(self) -> int:
        return hash((self.pp, self.vpp, self.num_microbatches, self.placement, self._orders))

    def __repr__(self) -> str:
        head = (f"Schedule({self.name!r}, pp={self.pp}, vpp={self.vpp}, "
                f"microbatches={self.num_microbatches}, placement={self.placement_kind!r}"
                + (", forward_only=True" if self.forward_only else "")
                + (f", recv_lookahead={self.recv_lookahead}" if self.recv_lookahead else ""))
        lines = []
        for rank in range(self.pp):
            order = self._orders[rank]
            text = " ".join(str(a) for a in order[:12])
            if len(order) > 12:
                text += f" ... ({len(order)} actions)"
            lines.append(f"  rank {rank}: {text}")
        return head + ",\n" + "\n".join(lines) + ")"
