"""`Schedule`: a training step as plain data, one ordered action list per pipeline rank."""
from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TypeVar

from ..errors import ScheduleError
from .action import ALL_OPS, COMM_OPS, COMPUTE_OPS, OVERLAP_F_B, SHARD_OPS, Action, flat_parts
from .comms import insert_comms
from .sharding import Sharding, insert_sharding
from .placement import make_placement, placement_kind

T = TypeVar("T")

_set = object.__setattr__        # construction and the private caches; the public face is frozen


class Schedule:
    """Per-rank ordered actions over ``num_stages = pp * vpp`` stages and ``num_microbatches``.

    Build it from per-rank lists of compute actions (communication is inserted by
    :func:`insert_comms`) or from full lists that already hold SEND/RECV actions (taken as they
    are, so hand-made schedules can be validated). ``placement`` is ``"looped"``, ``"v"`` or an
    explicit stage -> rank sequence. ``recv_lookahead`` is how many computations ahead of their
    consumer inserted receives are posted (see :mod:`pipesim.schedule.comms`). Equality
    compares the data (pp, vpp, microbatches, placement, routes, stage parts and actions), not
    the name.

    ``routes`` (optional, one per microbatch): the stages a microbatch goes through, a
    contiguous ascending run of stages given as a sequence (``range(4, 8)``) or as its
    ``(first, last)`` pair; by default every microbatch goes through every stage. Its input is
    fed at its first stage, its loss taken at its last. ``stage_parts`` (optional, one per
    stage): the piece of the model each stage computes, default the stage itself. Two stages of
    one part are copies of the same layers (tied weights); every route must compute the parts
    ``0 .. num_parts-1`` in order. Together they express DeepSeek's bidirectional DualPipe
    (``pipesim.schedule.builders.dualpipe``): half of the microbatches through stages
    ``0..pp-1``, the other half through their copies ``pp..2pp-1``, fed from the other end.

    ``sharding`` (optional, a :class:`pipesim.schedule.sharding.Sharding`): ZeRO as actions;
    `actions` then holds the ``UNSHARD`` / ``RESHARD`` / ``REDUCE_GRAD`` it asks for, inserted
    after the communication (:func:`pipesim.schedule.sharding.insert_sharding`). Lists that hold
    sharding actions by hand are taken as they are (with their SEND/RECV), as torch's
    "compute_comms" CSV.
    """

    __slots__ = ("name", "pp", "vpp", "num_microbatches", "placement", "forward_only",
                 "_orders", "_actions", "_rank_stages", "_validated", "_explicit_comms",
                 "recv_lookahead", "routes", "stage_parts", "_program", "sharding", "_sharded",
                 "_with_sharding", "_orders_validated", "_derived")

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
        routes: Sequence[Sequence[int]] | None = None,
        stage_parts: Sequence[int] | None = None,
        sharding: Sharding | None = None,
    ) -> None:
        for field, value in (("pp", pp), ("vpp", vpp), ("microbatches", num_microbatches)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ScheduleError(f"{field} must be a positive integer, got {value!r}")
        if not isinstance(recv_lookahead, int) or isinstance(recv_lookahead, bool) or recv_lookahead < 0:
            raise ScheduleError(f"recv_lookahead must be a non-negative integer, got {recv_lookahead!r}")
        _set(self, "name", name)
        _set(self, "recv_lookahead", recv_lookahead)
        _set(self, "pp", pp)
        _set(self, "vpp", vpp)
        _set(self, "num_microbatches", num_microbatches)
        _set(self, "forward_only", bool(forward_only))
        if isinstance(placement, str):
            _set(self, "placement", make_placement(placement, pp, vpp))
        else:
            _set(self, "placement", tuple(int(r) for r in placement))
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
        _set(self, "_rank_stages", tuple(tuple(s) for s in rank_stages))
        _set(self, "routes", _check_routes(routes, num_microbatches, pp * vpp))
        _set(self, "stage_parts", _check_parts(stage_parts, self.routes, pp * vpp, num_microbatches))

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
                has_comm = has_comm or a.op in COMM_OPS or a.op in SHARD_OPS
            if has_comm:
                compute.append(tuple(a for a in order if a.op in COMPUTE_OPS))
                full.append(order)
            else:
                compute.append(order)
                full.append(None)
        _set(self, "_orders", tuple(compute))
        _set(self, "_actions", full)
        _set(self, "_explicit_comms", any(a is not None for a in full))
        if self._explicit_comms and recv_lookahead:
            raise ScheduleError("recv_lookahead applies to inserted receives; this schedule's "
                                "SEND/RECV actions are given by hand")
        if sharding is not None and not isinstance(sharding, Sharding):
            raise ScheduleError(f"sharding must be a Sharding, got {sharding!r}")
        if sharding is not None and any(a.op in SHARD_OPS for o in orders for a in o):
            raise ScheduleError("this schedule's UNSHARD / RESHARD / REDUCE_GRAD actions are given "
                                "by hand; a sharding would insert them again")
        _set(self, "sharding", sharding if sharding is not None and sharding.inserts else None)
        _set(self, "_sharded", [None] * pp)  # actions with the sharding's, made on first use
        _set(self, "_validated", False)
        _set(self, "_program", None)         # lower(self), made on first use
        _set(self, "_with_sharding", {})     # with_sharding's copies, made on first use
        # [True] once validate_schedule passed on this schedule or on a sharded copy of it:
        # one list shared with its copies, which differ from it only in the sharding's actions
        _set(self, "_orders_validated", [False])
        _set(self, "_derived", {})          # derived(): values made from the orders, kept

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

    # -- routes and model parts ---------------------------------------------------------------
    @property
    def has_routes(self) -> bool:
        """True when some microbatch skips stages (its route is not every stage in order)."""
        return self.routes is not None

    def first_stage(self, microbatch: int) -> int:
        """The stage where ``microbatch``'s input is fed."""
        return 0 if self.routes is None else self.routes[microbatch][0]

    def last_stage(self, microbatch: int) -> int:
        """The stage that computes ``microbatch``'s loss."""
        return self.num_stages - 1 if self.routes is None else self.routes[microbatch][1]

    def route(self, microbatch: int) -> range:
        """The stages ``microbatch`` goes through, in order."""
        return range(self.first_stage(microbatch), self.last_stage(microbatch) + 1)

    def route_bounds(self) -> tuple[list[int], list[int]] | None:
        """(first stages, last stages), one per microbatch; None when every route is full."""
        if self.routes is None:
            return None
        return [r[0] for r in self.routes], [r[1] for r in self.routes]

    @property
    def num_parts(self) -> int:
        """How many pieces the model is cut into (``num_stages`` unless stages are copies)."""
        return self.num_stages if self.stage_parts is None else max(self.stage_parts) + 1

    @property
    def parts_per_rank(self) -> int:
        """Model parts per rank: what a run's (or a plan's) ``vpp`` counts. It is ``vpp``
        unless stages are copies (dualpipe: 1 part per rank, held as 2 stages)."""
        return self.num_parts // self.pp

    def stage_part(self, stage: int) -> int:
        """The piece of the model ``stage`` computes (two stages of one part share weights)."""
        return stage if self.stage_parts is None else self.stage_parts[stage]

    @property
    def has_copies(self) -> bool:
        """True when some model part is computed by several stages (tied copies)."""
        return self.stage_parts is not None

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
        """All actions of ``rank`` in execution order, SEND/RECV included (and the sharding's
        UNSHARD / RESHARD / REDUCE_GRAD, when it has one)."""
        full = self._actions[rank]
        if full is None:
            full = tuple(insert_comms(self._orders[rank], rank, self.placement, self.recv_lookahead,
                                      self.route_bounds()))
            self._actions[rank] = full
        if self.sharding is not None:
            sharded = self._sharded[rank]
            if sharded is None:
                sharded = self._sharded[rank] = tuple(insert_sharding(full, self.sharding))
            return list(sharded)
        return list(full)

    def derived(self, make: "Callable[..., T]", *args: Hashable) -> "T":
        """``make(self, *args)``, made on the first call and kept with the schedule (as
        :meth:`pipesim.schedule.program.Program.derived` keeps a program's): what a reader
        derives from the compute orders alone (a planner's bounds) then costs one lookup a
        plan. ``make`` must be a pure function of the compute orders and ``args`` returning
        an immutable value (tuples, read-only arrays): every caller of the same schedule, and
        of its sharded copies (`with_sharding`, the same orders), shares it."""
        key = (make, args)
        value = self._derived.get(key)
        if value is None:
            value = self._derived[key] = make(self, *args)
        return value

    def with_sharding(self, sharding: Sharding | None) -> "Schedule":
        """The same schedule with ``sharding``'s actions inserted (None, or ZeRO 0/1: none)."""
        if sharding is not None and not sharding.inserts:
            sharding = None
        if sharding == self.sharding:
            return self
        # kept: a planner asks a cached schedule for the same copy once a plan (thousands),
        # and the copy keeps its own lowering and validation
        copy = self._with_sharding.get(sharding)
        if copy is None:
            explicit = self._explicit_comms
            orders = [self._actions[r] if explicit else self._orders[r] for r in range(self.pp)]
            copy = Schedule(self.pp, self.vpp, self.num_microbatches, self.placement, orders,
                            name=self.name, forward_only=self.forward_only,
                            recv_lookahead=self.recv_lookahead, routes=self.routes,
                            stage_parts=self.stage_parts, sharding=sharding)
            if not explicit:
                # the same orders and inserted SEND/RECV: share their validation (what
                # validate() would find again is the base's: the inserted actions are the
                # rank's own, no message, no wait on another rank, so a copy's checks only
                # them), actions and what was derived from the orders
                _set(copy, "_orders_validated", self._orders_validated)
                _set(copy, "_actions", self._actions)
                _set(copy, "_derived", self._derived)
            self._with_sharding[sharding] = copy
        return copy

    def with_recv_lookahead(self, lookahead: int) -> "Schedule":
        """The same schedule with its receives posted ``lookahead`` computations early."""
        if lookahead == self.recv_lookahead:
            return self
        return self.with_orders(self._orders, recv_lookahead=lookahead)

    def with_orders(self, orders: Sequence[Iterable[Action]], *, recv_lookahead: int | None = None,
                    name: str | None = None, forward_only: bool | None = None) -> "Schedule":
        """A schedule of the same shape (placement, routes, stage parts) with other action lists."""
        return Schedule(self.pp, self.vpp, self.num_microbatches, self.placement, orders,
                        name=self.name if name is None else name,
                        forward_only=self.forward_only if forward_only is None else forward_only,
                        recv_lookahead=self.recv_lookahead if recv_lookahead is None else recv_lookahead,
                        routes=self.routes, stage_parts=self.stage_parts, sharding=self.sharding)

    @property
    def has_explicit_comms(self) -> bool:
        """True when the SEND/RECV actions were given by hand rather than inserted."""
        return self._explicit_comms

    @property
    def num_compute_actions(self) -> int:
        return sum(len(o) for o in self._orders)

    @property
    def kept_actions(self) -> int:
        """Compute actions of this schedule and of the sharded copies it keeps
        (`with_sharding`): what a cache holding it holds, in its unit."""
        return self.num_compute_actions * (1 + len(self._with_sharding))

    def validate(self, *, single_channel: bool = False) -> "Schedule":
        """Check ordering, send/receive matching and deadlock freedom; raise ScheduleError.

        ``single_channel``: also check that between every two ranks the receives are posted in
        the order of the sends, activations and gradients together, as
        torch.distributed.pipelining's runtime needs (see :mod:`pipesim.schedule.torch_order`).
        Returns the schedule itself, so ``build(...).validate()`` chains.
        """
        if not self._validated:
            from .validate import validate_schedule, validate_sharding

            if self._orders_validated[0]:
                # the orders, their messages and deadlock freedom passed on the schedule this
                # is a sharded copy of (or on another copy): only the sharding's actions differ
                validate_sharding(self)
            else:
                validate_schedule(self)
                self._orders_validated[0] = True
            _set(self, "_validated", True)
        if single_channel:
            from .torch_order import check_single_channel

            check_single_channel(self)
        return self

    # -- value semantics --------------------------------------------------------------------
    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(
            f"Schedule is immutable (cannot set {name!r}): build_schedule hands one Schedule to "
            f"every caller; make another with with_orders(..., name=...) or Schedule(...)")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Schedule is immutable (cannot delete {name!r})")

    def __getstate__(self) -> dict:
        """Pickled (and copied) without its lowered program, rebuilt on use."""
        return {k: getattr(self, k) for k in self.__slots__
                if k not in ("_program", "_sharded", "_with_sharding", "_derived")}

    def __setstate__(self, state: dict) -> None:
        for k, v in state.items():
            _set(self, k, list(v) if k == "_actions" else v)
        _set(self, "_program", None)
        if "sharding" not in state:         # pickled before sharding existed
            _set(self, "sharding", None)
        if "_orders_validated" not in state:
            _set(self, "_orders_validated", [self._validated])
        _set(self, "_sharded", [None] * self.pp)
        _set(self, "_with_sharding", {})
        _set(self, "_derived", {})

    def _key(self) -> tuple:
        return (self.pp, self.vpp, self.num_microbatches, self.placement,
                tuple(tuple(self.actions(r)) for r in range(self.pp)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Schedule):
            return NotImplemented
        if (self.pp, self.vpp, self.num_microbatches, self.placement, self.routes,
                self.stage_parts, self.sharding) != (other.pp, other.vpp, other.num_microbatches,
                                                     other.placement, other.routes,
                                                     other.stage_parts, other.sharding):
            return False
        return self._orders == other._orders and self._key() == other._key()

    def __hash__(self) -> int:
        return hash((self.pp, self.vpp, self.num_microbatches, self.placement, self.routes,
                     self.stage_parts, self._orders))

    def __repr__(self) -> str:
        head = (f"Schedule({self.name!r}, pp={self.pp}, vpp={self.vpp}, "
                f"microbatches={self.num_microbatches}, placement={self.placement_kind!r}"
                + (", forward_only=True" if self.forward_only else "")
                + (f", recv_lookahead={self.recv_lookahead}" if self.recv_lookahead else "")
                + (", routed" if self.routes is not None else "")
                + (f", zero={self.sharding.level} {self.sharding.grad_reduce}"
                   if self.sharding is not None else "")
                + (f", {self.num_parts} model parts" if self.stage_parts is not None else ""))
        lines = []
        for rank in range(self.pp):
            order = self._orders[rank]
            text = " ".join(str(a) for a in order[:12])
            if len(order) > 12:
                text += f" ... ({len(order)} actions)"
            lines.append(f"  rank {rank}: {text}")
        return head + ",\n" + "\n".join(lines) + ")"


def _check_routes(routes, m: int, n: int) -> tuple[tuple[int, int], ...] | None:
    """Routes as (first, last) stage pairs, one per microbatch; None when all are full."""
    if routes is None:
        return None
    routes = list(routes)
    if len(routes) != m:
        raise ScheduleError(f"routes: got {len(routes)} routes, expected one per microbatch ({m})")
    out = []
    for mb, route in enumerate(routes):
        stages = [int(s) for s in route]
        if len(stages) == 2 and stages[1] >= stages[0]:
            stages = list(range(stages[0], stages[1] + 1))     # a (first, last) pair
        if not stages or stages != list(range(stages[0], stages[0] + len(stages))):
            raise ScheduleError(
                f"routes: microbatch {mb}'s route {list(route)} is not a contiguous ascending run "
                "of stages (give range(first, last + 1) or [first, last])")
        if stages[0] < 0 or stages[-1] >= n:
            raise ScheduleError(f"routes: microbatch {mb}'s route {stages[0]}..{stages[-1]} "
                                f"leaves the stages 0..{n - 1}")
        out.append((stages[0], stages[-1]))
    if all(r == (0, n - 1) for r in out):
        return None
    return tuple(out)


def _check_parts(parts, routes, n: int, m: int) -> tuple[int, ...] | None:
    """Stage -> model part; every route must compute the parts 0..K-1 in order."""
    if parts is None:
        if routes is not None:          # without copies a shorter route skips model layers
            mb, (first, last) = next((mb, r) for mb, r in enumerate(routes) if r != (0, n - 1))
            raise ScheduleError(
                f"routes: microbatch {mb} goes through stages {first}..{last} only, so it "
                "skips model layers; give stage_parts saying which stages are copies of "
                "which part, so that every route computes the whole model")
        return None
    parts_t = tuple(int(p) for p in parts)
    if len(parts_t) != n:
        raise ScheduleError(f"stage_parts: got {len(parts_t)} values, expected one per stage ({n})")
    k = max(parts_t) + 1
    if min(parts_t) < 0 or set(parts_t) != set(range(k)):
        raise ScheduleError(f"stage_parts {list(parts_t)}: parts must be 0..{k - 1}, each used")
    for mb in range(m):
        first, last = routes[mb] if routes is not None else (0, n - 1)
        seq = list(parts_t[first:last + 1])
        if seq != list(range(k)):
            raise ScheduleError(
                f"stage_parts: microbatch {mb}'s route (stages {first}..{last}) computes parts "
                f"{seq}, expected the whole model in order, 0..{k - 1}")
    if parts_t == tuple(range(n)):
        return None
    return parts_t
