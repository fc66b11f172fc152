"""Megatron's interleaved 1F1B: vpp chunks per rank, looped placement (stage s on rank s % pp).

The order is the one Megatron's ``forward_backward_pipelining_with_interleaving`` executes,
written as data instead of as a loop over communication calls.

**Virtual microbatches.** Rank r runs ``vpp * m`` forwards; the k-th is the pair (chunk,
microbatch) in row k of Megatron-Core's *schedule table* (``get_schedule_table``): microbatches
are cut into groups of ``g = microbatch_group_size`` (Core's
``microbatch_group_size_per_vp_stage``, default pp), and each group runs on chunk 0, then chunk
1, ..., before the next group starts; the last group is whatever is left. With g == pp and m a
multiple of pp this is exactly legacy Megatron-LM's arithmetic: chunk ``(k % (pp*vpp)) // pp``,
microbatch ``(k // (pp*vpp)) * pp + k % pp``. The k-th backward is row k with the chunk reversed
(``vpp - 1 - chunk``); Megatron pops the oldest saved activation of that chunk, which is the
row's microbatch because each chunk's microbatches appear in the table in increasing order.
Chunk c of rank r is stage ``c * pp + r``.

**Phases.** ``w`` warm-up forwards, then one forward one backward (forward k+w, backward k),
then the remaining backwards. ``w = 2*(pp - r - 1) + (vpp - 1) * g``, capped at ``vpp * m``.

**The m == pp rule.** Legacy Megatron-LM special-cases ``m == pp``: every rank runs all its
forwards before any backward (``all_warmup_microbatches``). Megatron-Core dropped that branch
when it introduced microbatch groups: it only caps ``w`` at the total, so for m == pp the ranks
with ``2*(pp - r - 1) < pp`` still start 1F1B early. Everywhere else the two agree (m a multiple
of pp, g == pp), and m == pp forces g == pp in Core (g must lie in [pp, m]), so the rules meet
only on that one case. The builder follows legacy there by default (the all-warm-up order) and
gives Core's order with ``legacy_all_warmup=False``; for every other accepted parameter set the
option changes nothing.

**Accepted parameters** (the checks of Core's ``forward_backward_pipelining_with_interleaving``):
``pp <= g <= m`` (so m >= pp with the default g) and ``m % g`` either 0 or at least pp (a last
group smaller than pp leaves dependency bubbles, and Megatron raises). Legacy Megatron-LM
accepted only m a multiple of pp; with the default g that is what these checks leave too.

* ``vpp == 1``: Megatron has no interleaving then and runs the non-interleaved schedule, so the
  builder returns that order (1F1B: ``min(pp - r - 1, m)`` warm-up forwards) for any m, and
  ignores ``microbatch_group_size``.
* ``pp == 1`` with ``vpp > 1`` is rejected: Megatron routes pp == 1 to its no-pipelining
  schedule, which refuses model chunks.
* Megatron's argument check that pp > 2 unless p2p overlap is on is about batching two sends to
  the same peer, a communication detail; the schedule for pp == 2 is served.
* ``forward_only``: every forward in schedule-table order (Core sets warm-up to the total).

Not modelled: ``overlap_moe_expert_parallel_comm`` (one extra warm-up forward) and the p2p
overlap flags, which change when tensors move but not the order of compute.
"""
from __future__ import annotations

from ...errors import ScheduleError
from ..action import B, F, Action
from ..placement import LOOPED
from ..registry import register
from ..schedule import Schedule
from .simple import one_f_one_b_order

NAME = "interleaved"


def schedule_table(microbatches: int, vpp: int, group_size: int) -> list[tuple[int, int]]:
    """(chunk, microbatch) of each virtual microbatch, in the order a rank runs its forwards."""
    table: list[tuple[int, int]] = []
    for start in range(0, microbatches, group_size):
        group = range(start, min(start + group_size, microbatches))
        table.extend((chunk, mb) for chunk in range(vpp) for mb in group)
    return table


def warmup_forwards(pp: int, vpp: int, rank: int, microbatches: int, group_size: int | None = None,
                    *, legacy_all_warmup: bool = True) -> int:
    """How many forwards ``rank`` runs before its first backward (vpp > 1)."""
    g = pp if group_size is None else group_size
    total = vpp * microbatches
    if legacy_all_warmup and microbatches == pp:
        return total
    return min(2 * (pp - rank - 1) + (vpp - 1) * g, total)


def check_interleaved(pp: int, vpp: int, microbatches: int, group_size: int) -> None:
    """Raise ScheduleError, in words, for what Megatron's interleaved schedule refuses."""
    if pp < 2:
        raise ScheduleError(
            f"{NAME} needs pp >= 2 when vpp > 1, got pp = {pp}, vpp = {vpp} (Megatron runs pp == 1 "
            "without pipelining, which does not support model chunks)")
    if microbatches < pp:
        raise ScheduleError(
            f"{NAME} needs microbatches >= pp, got microbatches = {microbatches}, pp = {pp} "
            "(Megatron-Core: a microbatch group must hold between pp and microbatches microbatches)")
    if not pp <= group_size <= microbatches:
        raise ScheduleError(
            f"{NAME} needs pp <= microbatch_group_size <= microbatches, got "
            f"microbatch_group_size = {group_size}, pp = {pp}, microbatches = {microbatches}")
    last = microbatches % group_size
    if 0 < last < pp:
        fits = [g for g in range(pp, microbatches + 1) if microbatches % g == 0 or microbatches % g >= pp]
        shown = ", ".join(map(str, fits[:6])) + (", ..." if len(fits) > 6 else "")
        near = [m for m in range(max(pp, microbatches - 2 * pp), microbatches + 2 * pp + 1)
                if m % group_size == 0 or m % group_size >= pp][:4]
        raise ScheduleError(
            f"{NAME} needs microbatches % microbatch_group_size to be 0 or >= pp, got "
            f"{microbatches} % {group_size} = {last} with pp = {pp} (a last microbatch group smaller "
            f"than pp leaves dependency bubbles); microbatch counts (--microbatches) that work with group size "
            f"{group_size}: {', '.join(map(str, near))}; or, from Python, build_schedule(..., "
            f"microbatch_group_size=G), G one of the sizes that work for microbatches = {microbatches}: "
            f"{shown}")


def interleaved_order(pp: int, vpp: int, rank: int, microbatches: int, group_size: int, *,
                      legacy_all_warmup: bool = True, forward_only: bool = False) -> list[Action]:
    """Compute order of one rank: warm-up forwards, 1F1B, cool-down backwards."""
    w = warmup_forwards(pp, vpp, rank, microbatches, group_size, legacy_all_warmup=legacy_all_warmup)
    return _order(pp, vpp, rank, schedule_table(microbatches, vpp, group_size), w, forward_only)


def _order(pp: int, vpp: int, rank: int, table: list[tuple[int, int]], warmup: int,
           forward_only: bool) -> list[Action]:
    forwards = [Action(F, chunk * pp + rank, mb) for chunk, mb in table]
    if forward_only:
        return forwards
    backwards = [Action(B, (vpp - 1 - chunk) * pp + rank, mb) for chunk, mb in table]
    steady = len(table) - warmup
    order = forwards[:warmup]
    for k in range(steady):
        order.append(forwards[warmup + k])
        order.append(backwards[k])
    order.extend(backwards[steady:])
    return order


def _default_check(pp: int, vpp: int, microbatches: int) -> None:
    """What the builder refuses with its default group size (pp)."""
    if vpp > 1:
        check_interleaved(pp, vpp, microbatches, pp)


@register(NAME, placement=LOOPED, check=_default_check, searched_vpp=None,
          constraints="vpp > 1: pp >= 2, microbatches >= pp, pp <= microbatch_group_size <= "
                      "microbatches, microbatches % microbatch_group_size == 0 or >= pp (the group "
                      "size defaults to pp: microbatches a multiple of pp); vpp == 1: 1f1b, any m",
          description="Megatron-LM interleaved 1F1B: vpp chunks per rank (stage s on rank s % pp), "
                      "microbatch groups of microbatch_group_size per chunk, warm-up "
                      "2(pp-r-1) + (vpp-1)*group forwards")
def interleaved(pp: int, vpp: int, microbatches: int, *, forward_only: bool = False,
                microbatch_group_size: int | None = None, legacy_all_warmup: bool = True,
                **unknown: object) -> Schedule:
    """Build the interleaved schedule; see the module docstring for the rules and options."""
    if unknown:
        raise ScheduleError(
            f"{NAME}: unknown option(s) {', '.join(sorted(unknown))}; known options: "
            "microbatch_group_size, legacy_all_warmup")
    g = pp if microbatch_group_size is None else microbatch_group_size
    if not isinstance(g, int) or isinstance(g, bool) or g < 1:
        raise ScheduleError(f"{NAME}: microbatch_group_size must be a positive integer, got {g!r}")
    if vpp == 1:  # Megatron runs its non-interleaved schedule
        if forward_only:
            orders = [[Action(F, r, mb) for mb in range(microbatches)] for r in range(pp)]
        else:
            orders = [one_f_one_b_order(r, pp - r - 1, microbatches) for r in range(pp)]
    else:
        check_interleaved(pp, vpp, microbatches, g)
        table = schedule_table(microbatches, vpp, g)  # the same on every rank
        orders = [_order(pp, vpp, r, table, warmup_forwards(
            pp, vpp, r, microbatches, g, legacy_all_warmup=legacy_all_warmup), forward_only)
            for r in range(pp)]
    return Schedule(pp, vpp, microbatches, LOOPED, orders, name=NAME, forward_only=forward_only)
