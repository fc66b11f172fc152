"""Schedule builders registered by name.

A builder is a pure function ``(pp, vpp, microbatches, *, forward_only, **options) -> Schedule``.
The registry is filled once, at import, by the builder modules; nothing mutates it afterwards.

Each builder registers what a planner needs without building it: its ``check`` (the
(pp, vpp, microbatches) it refuses with its default options, the same function the builder
calls first) and its placement (:func:`schedule_rank_parts`: which model parts each rank holds,
copies included). :func:`schedule_refusal` is the one answer to "does this schedule fit pp, vpp,
microbatches?", for a name or a Schedule given as data: the planner, a plan, pipeexec's config
and the command lines ask it.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from collections import OrderedDict

from ..errors import ScheduleError
from .placement import rank_part_runs, rank_parts
from .schedule import Schedule

Builder = Callable[..., Schedule]
Check = Callable[[int, int, int], None]


@dataclass(frozen=True)
class BuilderInfo:
    name: str
    builder: Builder
    placement: str       # "looped" or "v"
    constraints: str     # in words, as `pipesim list` prints them
    description: str     # one line
    # (pp, vpp, microbatches) -> None, or ScheduleError naming the broken constraint: what the
    # builder refuses with its default options (None: only building the schedule tells)
    check: Check | None = None
    copies: bool = False  # pp * vpp model parts on 2 * vpp stages a rank (DualPipe's copies)
    # the vpp a planner searches it at (model parts a rank); None: the search's vpp values > 1
    searched_vpp: int | None = 1
    # pairs a forward and a backward in one action (OVERLAP_F_B): one ZeRO-3 gather may serve both
    overlapped: bool = False
    # every backward split into I and W, two actions (the zero-bubble family)
    split_backward: bool = False


_BUILDERS: dict[str, BuilderInfo] = {}


def register(name: str, *, placement: str, constraints: str, description: str,
             check: Check | None = None, copies: bool = False,
             searched_vpp: int | None = 1, overlapped: bool = False,
             split_backward: bool = False) -> Callable[[Builder], Builder]:
    def wrap(fn: Builder) -> Builder:
        if name in _BUILDERS:
            raise ValueError(f"schedule {name!r} is registered twice")
        _BUILDERS[name] = BuilderInfo(name, fn, placement, constraints, description, check,
                                      copies, searched_vpp, overlapped, split_backward)
        return fn
    return wrap


def _load_builders() -> None:
    from . import builders  # noqa: F401  (imports register every builder)


def schedule_names() -> list[str]:
    """Names accepted by :func:`build_schedule`, in registration order."""
    _load_builders()
    return list(_BUILDERS)


def schedule_info(name: str) -> BuilderInfo:
    _load_builders()
    try:
        return _BUILDERS[name]
    except KeyError:
        raise ScheduleError(
            f"unknown schedule {name!r}; known schedules: {', '.join(_BUILDERS)}") from None


def schedule_refusal(schedule: str | Schedule, pp: int, vpp: int, microbatches: int, *,
                     asked: str = "asked", flags: bool = False) -> str | None:
    """Why ``schedule`` does not fit (pp, vpp, microbatches), in words; None when it does.

    A name: what its builder refuses with its default options, in the builder's own words.
    Cheap: the sizes' bounds and the builder's registered ``check``, not a build (a builder
    registered without one is built, remembered as every plain build is). A Schedule (given as
    data: a file, a plan's): the first of pp, vpp (model parts a rank) and microbatches it has
    otherwise, ``the schedule has vpp = 2, {asked} vpp = 1`` (``flags``: then ``; pass --vpp 2``,
    for a command line)."""
    if isinstance(schedule, Schedule):
        for field, want, got in (("pp", pp, schedule.pp), ("vpp", vpp, schedule.parts_per_rank),
                                 ("microbatches", microbatches, schedule.num_microbatches)):
            if got != want:
                return (f"the schedule has {field} = {got}, {asked} {field} = {want}"
                        + (f"; pass --{field} {got}" if flags else ""))
        return None
    info = schedule_info(schedule)
    try:
        if info.check is None:
            build_schedule(schedule, pp=pp, microbatches=microbatches, vpp=vpp)
        else:
            _check_sizes(schedule, pp, vpp, microbatches)
            check_size(schedule, vpp, microbatches)
            info.check(pp, vpp, microbatches)
    except ScheduleError as exc:
        return str(exc)
    return None


def schedule_rank_parts(name: str, pp: int, vpp: int) -> tuple[tuple[int, ...], ...]:
    """The model parts (``pp * vpp`` of them) each rank holds under the named schedule, from
    its registered placement (a copy of a part is listed again): no schedule is built."""
    info = schedule_info(name)
    return rank_parts(info.placement, pp, vpp, copies=info.copies)


def schedule_part_runs(name: str, pp: int, vpp: int, microbatches: int
                       ) -> tuple[dict[int, int], ...]:
    """Per rank, model part -> microbatches the rank runs through it under the named schedule
    (``microbatches`` for each, unless the schedule's copies share them): no schedule built."""
    info = schedule_info(name)
    return rank_part_runs(info.placement, pp, vpp, microbatches, copies=info.copies)


def _check_sizes(name: str, pp: int, vpp: int, microbatches: int) -> None:
    for field, value in (("pp", pp), ("vpp", vpp), ("microbatches", microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"{name}: {field} must be a positive integer, got {value!r}")


def build_schedule(name: str, pp: int, microbatches: int, vpp: int = 1, *,
                   forward_only: bool = False, recv_lookahead: int = 0, **options) -> Schedule:
    """Build the named schedule; raise ScheduleError naming the constraint it breaks.

    ``recv_lookahead``: post each receive that many computations before the one that needs it
    (0: right before it); see :mod:`pipesim.schedule.comms`.
    """
    info = schedule_info(name)
    _check_sizes(name, pp, vpp, microbatches)
    check_size(name, vpp, microbatches)
    if options:
        check_options(info, options)
    if options or not isinstance(recv_lookahead, int):   # costs, limits, group sizes: afresh
        schedule = info.builder(pp, vpp, microbatches, forward_only=forward_only, **options)
        return schedule.with_recv_lookahead(recv_lookahead)
    return _built(name, pp, vpp, microbatches, bool(forward_only), recv_lookahead)


# The most computations one rank's order may hold: 2**18. Building, checking and simulating
# take time and memory in proportion (about 0.1 ms and a few hundred bytes each here), so the
# bound keeps a mistyped size (--microbatches 100000000) from running for minutes before it
# says anything. Real steps are far below it: Megatron's largest published runs have
# microbatches x vpp in the thousands (GPT-3 175B: global batch 1536 over dp 8, m = 192,
# vpp up to 12: 2,304), and the bound allows 87,381 (F, B and W of each).
MAX_ACTIONS_PER_RANK = 2 ** 18


def check_size(name: str, vpp: int, microbatches: int) -> None:
    """Refuse, before building anything, a schedule whose ranks would each run more than
    `MAX_ACTIONS_PER_RANK` computations (counted as a split backward's three a microbatch and
    model chunk: F, B and W)."""
    per_rank = 3 * microbatches * vpp
    if per_rank > MAX_ACTIONS_PER_RANK:
        raise ScheduleError(
            f"{name}: {microbatches:,} microbatches x vpp {vpp} make up to {per_rank:,} "
            f"computations a rank, beyond pipesim's bound of {MAX_ACTIONS_PER_RANK:,} "
            "(MAX_ACTIONS_PER_RANK): the schedule alone would take minutes and gigabytes to "
            "build; give fewer microbatches (a smaller global batch, a larger micro-batch size)")


def check_options(info: BuilderInfo, options: dict) -> None:
    """Refuse option names ``info``'s builder does not take, naming those it does (a builder
    with ``**`` options checks its own)."""
    params = inspect.signature(info.builder).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    known = [n for n, p in params.items()
             if p.kind is inspect.Parameter.KEYWORD_ONLY and n != "forward_only"]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ScheduleError(f"{info.name}: unknown schedule option(s) {', '.join(unknown)}; "
                            + (f"known options: {', '.join(known)}" if known else
                               "it takes no options"))


class _BuildCache:
    """Built schedules for plain arguments, remembered: builders are pure and a Schedule is
    immutable, and a planner asks for the same (schedule, pp, vpp, m) for every plan that shares
    them (tp, cp, dp, recomputation, sharding differ), in the order of their bounds, not
    together. Least recently used first out, sized by compute actions rather than by entries
    (a schedule keeps its validation and lowering, about 2 KB an action once simulated, and
    its sharded copies, `Schedule.kept_actions`): a
    search's few hundred distinct small schedules all stay, and a few large ones do not take a
    process's memory. A refusal is raised again (not remembered)."""

    def __init__(self, max_actions: int, max_entries: int) -> None:
        self.max_actions, self.max_entries = max_actions, max_entries
        self._entries: OrderedDict[tuple, Schedule] = OrderedDict()
        self._actions = 0
        self.hits = self.misses = 0

    def __call__(self, name: str, pp: int, vpp: int, microbatches: int, forward_only: bool,
                 recv_lookahead: int) -> Schedule:
        key = (name, pp, vpp, microbatches, forward_only, recv_lookahead)
        schedule = self._entries.get(key)
        if schedule is not None:
            self.hits += 1
            self._entries.move_to_end(key)
            return schedule
        self.misses += 1
        schedule = _BUILDERS[name].builder(pp, vpp, microbatches, forward_only=forward_only)
        schedule = schedule.with_recv_lookahead(recv_lookahead)
        self._entries[key] = schedule
        # counted again on every miss: an entry grows with the sharded copies it keeps
        self._actions = sum(s.kept_actions for s in self._entries.values())
        while len(self._entries) > 1 and (self._actions > self.max_actions
                                           or len(self._entries) > self.max_entries):
            _, old = self._entries.popitem(last=False)
            self._actions -= old.kept_actions
        return schedule

    def cache_clear(self) -> None:
        self._entries.clear()
        self._actions = 0


_built = _BuildCache(max_actions=400_000, max_entries=2048)
