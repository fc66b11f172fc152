"""zb-auto on a search's best layouts: a searched order per plan, after the enumeration.

zb-auto's order depends on one plan's costs and memory limit, so the enumeration cannot list
it; instead the best ``top`` fitting plans' layouts (tp, cp, pp, vpp 1 or 2, dp, ep, micro-batch
size, recomputation, sharding: a layout that several schedules share is searched once) get a
zb-auto search from that plan's derived costs under the same per-GPU limit, simulated as the
search simulates (:func:`pipesim.sim.plan_report.simulate_plan`), candidates ranked by the plan's
step (each rank's end plus its exposed data-parallel reduction and optimizer step: zb-auto's
``tail``; under ZeRO-2/3 each candidate lowered with the plan's sharding: ``sharding``), not by
the pipeline's makespan alone. The searched plan holds its
schedule as data, so ``plan.json`` carries it to ``pipesim simulate --plan`` and
``pipeexec train --plan``. zb-auto keeps the fastest handcrafted order of its vpp that fits when
none of its own is faster (never predicted slower than those), so a refinement reports the
searched step next to the plan's own, and the gain is what it is, zero included.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import PlanError, ScheduleError
from ..plan.plan import Plan
from ..sim.plan_report import simulate_plan
from ..schedule.registry import build_schedule
from ..units import GiB
from ..zb_auto.search import handcrafted_origin
from .search import SearchResult

LAYOUT_COLUMNS = ("tp", "cp", "pp", "vpp", "dp", "ep", "mbs", "recompute", "zero")


@dataclass(frozen=True)
class Refinement:
    """One layout's zb-auto search: the ranked plan it started from and what the search gave
    (``searched`` None, with ``reason``, when it gave nothing that fits)."""

    base_key: str
    base: Plan
    base_step: float
    searched: Plan | None
    searched_step: float | None
    searched_peak: float | None
    handcrafted: str | None = None       # the handcrafted order zb-auto kept, if it kept one
    reason: str = ""

    @property
    def gain(self) -> float | None:
        """The searched plan's step time saved, as a fraction of the base plan's."""
        if self.searched_step is None:
            return None
        return 1.0 - self.searched_step / self.base_step


def refine_with_zb_auto(result: SearchResult, top: int = 3, *, margin: float = 0.0
                        ) -> list[Refinement]:
    """zb-auto searched for each of the best ``top`` distinct layouts of ``result`` (fastest
    first); ``margin`` as zb-auto's (a searched order must be that much faster than the
    handcrafted ones)."""
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(f"refine: top must be a positive number of layouts, got {top!r}")
    ranked = result.ranked
    seen: set[tuple] = set()
    out: list[Refinement] = []
    for _, row in ranked.iterrows():
        if len(out) == top:
            break
        layout = tuple(row[c] for c in LAYOUT_COLUMNS)
        if layout in seen:
            continue
        seen.add(layout)
        base = result.plans[row["key"]]
        par = base.parallelism
        common = dict(base_key=row["key"], base=base, base_step=float(row["step_time"]))
        if par.vpp not in (1, 2) or par.pp < 2:
            out.append(Refinement(**common, searched=None, searched_step=None, searched_peak=None,
                                  reason=f"zb-auto searches pp >= 2 at vpp 1 or 2 (here pp "
                                         f"{par.pp}, vpp {par.vpp})"))
            continue
        best, failures = None, []
        for kind in (("looped", "v") if par.vpp == 2 else ("looped",)):
            try:
                found = _search(base, kind, result.memory_limit, margin)
            except (ScheduleError, PlanError) as exc:
                failures.append(f"{kind}: {exc}")
                continue
            if not found[1].fits:
                failures.append(f"{kind}: {found[1].fit_message}")
            elif best is None or found[1].step_time < best[1].step_time:
                best = found
        if best is None:
            out.append(Refinement(**common, searched=None, searched_step=None,
                                  searched_peak=None, reason="; ".join(failures)))
            continue
        plan, sim = best
        out.append(Refinement(**common, searched=plan, searched_step=sim.step_time,
                              searched_peak=max(sim.peak_memory),
                              handcrafted=handcrafted_origin(plan.schedule)))
    return out


# a handcrafted schedule of each placement: what a plan's ranks hold under it (their weights,
# optimizer state, data-parallel tail) before zb-auto's order exists
_PLACED = {("looped", 1): "1f1b", ("looped", 2): "interleaved", ("v", 2): "zbv"}


def _search(base: Plan, kind: str, memory_limit: float, margin: float):
    """zb-auto in one placement, from the costs of ``base``'s layout in that placement; the
    plan holding the order, and its simulation."""
    par = base.parallelism
    derived = dataclasses.replace(base, schedule=_PLACED[kind, par.vpp]).derive()
    tail = [t.seconds for t in derived.tail]      # a plan's step
    schedule = build_schedule("zb-auto", pp=par.pp, microbatches=par.microbatches, vpp=par.vpp,
                              placement=kind, costs=derived.costs, tail=tail,
                              memory_limit=memory_limit, margin=margin,
                              sharding=par.sharding)     # ranked as the plan's program runs
    plan = dataclasses.replace(base, schedule=schedule)
    return plan, simulate_plan(plan)


def refinement_text(refinements: list[Refinement]) -> str:
    lines = [f"zb-auto on the best {len(refinements)} layouts (its order searched from each "
             "plan's costs under the same limit):",
             f"  {'plan':<58} {'step s':>8} {'zb-auto s':>9} {'gain':>7} {'peak GiB':>8}  order"]
    from ..units import column_decimals

    d = column_decimals([x for r in refinements for x in (r.base_step, r.searched_step)
                         if x is not None])
    for r in refinements:
        if r.searched is None:
            lines.append(f"  {r.base_key:<58} {r.base_step:>8.{d}f} {'-':>9} {'-':>7} "
                         f"{'-' if r.searched_peak is None else f'{r.searched_peak / GiB:.1f}':>8}"
                         f"  {r.reason}")
            continue
        order = f"{r.handcrafted}'s" if r.handcrafted else "searched"
        lines.append(f"  {r.base_key:<58} {r.base_step:>8.{d}f} {r.searched_step:>9.{d}f} "
                     f"{r.gain:>+7.1%} {r.searched_peak / GiB:>8.1f}  {order}")
    return "\n".join(lines)
