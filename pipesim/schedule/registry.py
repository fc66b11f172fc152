"""Schedule builders registered by name.

A builder is a pure function ``(pp, vpp, microbatches, *, forward_only, **options) -> Schedule``.
The registry is filled once, at import, by the builder modules; nothing mutates it afterwards.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from ..errors import ScheduleError
from .schedule import Schedule

Builder = Callable[..., Schedule]


@dataclass(frozen=True)
class BuilderInfo:
    name: str
    builder: Builder
    placement: str       # "looped" or "v"
    constraints: str     # in words, as `pipesim list` prints them
    description: str     # one line


_BUILDERS: dict[str, BuilderInfo] = {}


def register(name: str, *, placement: str, constraints: str, description: str
             ) -> Callable[[Builder], Builder]:
    def wrap(fn: Builder) -> Builder:
        if name in _BUILDERS:
            raise ValueError(f"schedule {name!r} is registered twice")
        _BUILDERS[name] = BuilderInfo(name, fn, placement, constraints, description)
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


def build_schedule(name: str, pp: int, microbatches: int, vpp: int = 1, *,
                   forward_only: bool = False, recv_lookahead: int = 0, **options) -> Schedule:
    """Build the named schedule; raise ScheduleError naming the constraint it breaks.

    ``recv_lookahead``: post each receive that many computations before the one that needs it
    (0: right before it); see :mod:`pipesim.schedule.comms`.
    """
    info = schedule_info(name)
    for field, value in (("pp", pp), ("vpp", vpp), ("microbatches", microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"{name}: {field} must be a positive integer, got {value!r}")
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


@lru_cache(maxsize=128)
def _built(name: str, pp: int, vpp: int, microbatches: int, forward_only: bool,
           recv_lookahead: int) -> Schedule:
    """A builder's result for plain arguments, remembered: builders are pure and a Schedule
    is immutable, and a planner asks for the same (schedule, pp, vpp, m) for every plan that
    shares them (tp, cp, dp, recomputation, sharding differ). A refusal is raised again."""
    schedule = _BUILDERS[name].builder(pp, vpp, microbatches, forward_only=forward_only)
    return schedule.with_recv_lookahead(recv_lookahead)
