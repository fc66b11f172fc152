"""GPipe, 1F1B (PipeDream-Flush) and looped breadth-first: the schedules with one idea each."""
from __future__ import annotations

from collections.abc import Callable

from ...errors import ScheduleError
from ..action import B, F, Action
from ..placement import LOOPED
from ..registry import register
from ..schedule import Schedule


def require_vpp(name: str, vpp: int, want: int, hint: str = "") -> None:
    if vpp != want:
        raise ScheduleError(f"{name} needs vpp == {want}, got vpp = {vpp}{hint}")


def vpp_check(name: str, want: int, hint: str = "") -> Callable[[int, int, int], None]:
    """A builder's check (see `register`) when all it needs is ``vpp == want``."""
    def check(pp: int, vpp: int, microbatches: int) -> None:
        require_vpp(name, vpp, want, hint)
    return check


def accept_all(pp: int, vpp: int, microbatches: int) -> None:
    """The check of a builder that takes every (pp, vpp, microbatches)."""


_gpipe_check = vpp_check("gpipe", 1, " (use looped-bfs for several chunks per rank)")
_1f1b_check = vpp_check("1f1b", 1, " (use interleaved for several chunks per rank)")


@register("gpipe", placement=LOOPED, constraints="vpp == 1", check=_gpipe_check,
          description="GPipe: every forward, then every backward (peak memory: all m microbatches)")
def gpipe(pp: int, vpp: int, microbatches: int, *, forward_only: bool = False) -> Schedule:
    _gpipe_check(pp, vpp, microbatches)
    orders = []
    for rank in range(pp):
        order = [Action(F, rank, mb) for mb in range(microbatches)]
        if not forward_only:
            order += [Action(B, rank, mb) for mb in range(microbatches)]
        orders.append(order)
    return Schedule(pp, 1, microbatches, LOOPED, orders, name="gpipe", forward_only=forward_only)


def one_f_one_b_order(stage: int, warmup: int, microbatches: int) -> list[Action]:
    """Warm-up forwards, then one forward one backward, then cool-down backwards."""
    warmup = min(warmup, microbatches)
    steady = microbatches - warmup
    order = [Action(F, stage, mb) for mb in range(warmup)]
    for k in range(steady):
        order.append(Action(F, stage, warmup + k))
        order.append(Action(B, stage, k))
    order += [Action(B, stage, mb) for mb in range(steady, microbatches)]
    return order


@register("1f1b", placement=LOOPED, constraints="vpp == 1", check=_1f1b_check,
          description="PipeDream-Flush as in Megatron-LM: rank r warms up with min(pp-r-1, m) "
                      "forwards, then alternates F and B (peak memory: pp-r microbatches)")
def one_f_one_b(pp: int, vpp: int, microbatches: int, *, forward_only: bool = False) -> Schedule:
    _1f1b_check(pp, vpp, microbatches)
    if forward_only:
        orders = [[Action(F, r, mb) for mb in range(microbatches)] for r in range(pp)]
    else:
        orders = [one_f_one_b_order(r, pp - r - 1, microbatches) for r in range(pp)]
    return Schedule(pp, 1, microbatches, LOOPED, orders, name="1f1b", forward_only=forward_only)


@register("looped-bfs", placement=LOOPED, constraints="any vpp", check=accept_all,
          searched_vpp=None,
          description="Breadth-first (Lamy-Poirier 2022): each local chunk runs every microbatch "
                      "before the next chunk; backward in reverse")
def looped_bfs(pp: int, vpp: int, microbatches: int, *, forward_only: bool = False) -> Schedule:
    orders = []
    for rank in range(pp):
        stages = [c * pp + rank for c in range(vpp)]
        order = [Action(F, s, mb) for s in stages for mb in range(microbatches)]
        if not forward_only:
            order += [Action(B, s, mb) for s in reversed(stages) for mb in reversed(range(microbatches))]
        orders.append(order)
    return Schedule(pp, vpp, microbatches, LOOPED, orders, name="looped-bfs", forward_only=forward_only)
