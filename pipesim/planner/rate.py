"""Rate a user's own plan against the search's best, and the differences that cost the most.

Why: "the planner's pick is 1.37x faster" says nothing about which of your choices costs it.
Here the user's plan is simulated as it is, then changed one knob at a time to the best plan's
value (tp, cp and pp keep the GPU count by moving dp, and a change of the stage count takes the
best plan's split of the layers where yours names one; the schedule and vpp move together; ep
to 1 takes ep 1's one dispatcher, the default, and the best plan's dispatcher is a knob only
where its ep > 1, as the search tries them; recomputation other than selective drops
selective's modules), each change simulated; the changes are listed by the step time they save, the invalid ones with the
reason. Where no one knob closes the gap, two often do: the two that save the most are also
simulated together (`Rating.together`). The same cluster and memory limit as the search.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import PlanError
from ..plan.parallelism import DEFAULT_EP_DISPATCHER
from ..plan.plan import Plan
from ..sim.plan_report import simulate_plan
from ..units import GiB

KNOBS = ("schedule", "tp", "cp", "pp", "micro_batch_size", "recompute", "zero",
         "sequence_parallel", "ep", "ep_dispatcher",
         # terms the search does not vary but a plan may set (a published run's framework
         # defaults: Megatron's --tp-comm-overlap, the GEMM precision...): a rating that
         # differs from the pick in them says so, with what each costs
         "precision", "overlap_tp_comm", "overlap_grad_reduce", "overlap_param_gather",
         "flash_attention", "cp_comm", "overlap_ep_comm",
         "recompute_modules", "offload_layers", "grad_reduce")


@dataclass(frozen=True)
class KnobChange:
    knob: str
    mine: object
    best: object
    step_time: float | None      # the user's plan with this one knob changed (None: invalid)
    fits: bool
    reason: str = ""

    @property
    def what(self) -> str:
        """``knob mine -> best``; for two knobs made together (knob ``a + b``), each."""
        if " + " not in self.knob:
            return f"{self.knob} {self.mine} -> {self.best}"
        return " and ".join(f"{k} {a} -> {b}" for k, a, b in
                            zip(self.knob.split(" + "), self.mine, self.best))

    def outcome(self, base: float) -> str:
        """Its step time, the saving against ``base`` and whether it fits (valid changes)."""
        fit = "" if self.fits else "  (does not fit)"
        return f"{self.step_time:.4g} s, {_faster(1 - self.step_time / base)}{fit}"


@dataclass(frozen=True)
class Rating:
    step_time: float
    best_step_time: float
    fits: bool
    fit_message: str
    changes: list[KnobChange]
    # the two changes that save the most, made together ("a + b"; None: fewer than two save)
    together: KnobChange | None = None

    @property
    def relative(self) -> float:
        """The user's throughput as a fraction of the best's."""
        return self.best_step_time / self.step_time

    def text(self) -> str:
        lines = [f"your plan: {self.step_time:.4g} s a step, {self.relative:.2f}x the best plan's "
                 f"throughput ({self.best_step_time:.4g} s); {self.fit_message}",
                 "one knob at a time, your plan with the best plan's value (largest saving first):"]
        if not self.changes:
            lines.append("  (none: your plan has the best plan's knobs)")
        for c in self.changes:
            done = (f"not valid alone ({c.reason})" if c.step_time is None
                    else c.outcome(self.step_time))
            lines.append(f"  {c.what}: {done}")
        t = self.together
        if t is not None:
            done = f"not valid ({t.reason})" if t.step_time is None else t.outcome(self.step_time)
            lines.append(f"the two largest together: {t.what}: {done}")
        return "\n".join(lines)


def _faster(gain: float) -> str:
    """``12.1% faster`` / ``3.0% slower``: a change can cost time (it may only save memory)."""
    return f"{gain:.1%} faster" if gain >= 0 else f"{-gain:.1%} slower"


def fit_text(peaks: list[float], limit: float) -> str:
    """Whether the plan's worst rank fits the search's limit (``--memory-limit`` or the GPU's
    usable memory): the same limit the ranked plans were held to, so the two compare."""
    worst = max(range(len(peaks)), key=peaks.__getitem__)
    gap = (peaks[worst] - limit) / GiB
    head = f"peak {peaks[worst] / GiB:.2f} GiB on rank {worst}"
    if gap <= 0:
        return f"fits: {head}, {-gap:.2f} GiB under the search's {limit / GiB:.2f} GiB limit"
    return f"does not fit: {head}, {gap:.2f} GiB over the search's {limit / GiB:.2f} GiB limit"


def _value(plan: Plan, knob: str):
    if knob == "schedule":
        return (plan.schedule_name, plan.parallelism.vpp)
    return getattr(plan.parallelism, knob)


# how a plan splits its layers into stages (Plan's fields): a split written for one number
# of stages (an explicit partition, Megatron's --pipeline-model-parallel-layout) means nothing
# for another
SPLIT = ("partition", "partition_layout", "first_stage_layers", "last_stage_layers",
         "account_for_embedding", "account_for_loss")


def _with(plan: Plan, knob: str, value, best: Plan) -> Plan:
    """``plan`` with ``knob`` at ``value``. A change of the stage count (pp, or the schedule's
    vpp) takes ``best``'s split of the layers where ``plan`` names its own, which was written
    for its count of stages."""
    par = plan.parallelism
    if knob == "schedule":
        name, vpp = value
        changed = plan.with_(schedule=name, vpp=vpp)
    elif knob in ("tp", "cp", "pp"):
        sizes = {"tp": par.tp, "cp": par.cp, "pp": par.pp, knob: value}
        rest = sizes["tp"] * sizes["cp"] * sizes["pp"]
        if par.world_size % rest:
            raise PlanError(f"{knob} {value}: tp*cp*pp = {rest} does not divide the "
                            f"{par.world_size} GPUs")
        changed = plan.with_(**{knob: value, "dp": par.world_size // rest})
    elif knob == "ep" and value == 1:           # ep 1 has one dispatcher: the default
        changed = plan.with_(ep=1, ep_dispatcher=DEFAULT_EP_DISPATCHER)
    elif knob == "recompute" and value != "selective":   # the modules are selective's
        changed = plan.with_(recompute=value, recompute_modules=())
    else:
        changed = plan.with_(**{knob: value})
    own = plan.partition is not None or plan.partition_layout is not None
    if own and changed.parallelism.num_stages != par.num_stages:
        changed = replace(changed, **{f: getattr(best, f) for f in SPLIT})
    return changed


def rate_plan(mine: Plan, best: Plan, memory_limit: float) -> Rating:
    """See the module docstring; ``memory_limit`` in bytes (the search's)."""
    if mine.world_size != best.world_size:
        raise PlanError(f"--rate: the plan uses {mine.world_size} GPUs, the search "
                        f"{best.world_size}: give --gpus {mine.world_size}")
    mine = mine.with_(cluster=best.cluster) if mine.cluster.hardware != best.cluster.hardware \
        else mine
    r = simulate_plan(mine)
    b = simulate_plan(best)
    changes = []
    for knob in KNOBS:
        a, v = _value(mine, knob), _value(best, knob)
        if a == v or (knob == "ep_dispatcher" and best.parallelism.ep == 1):
            continue
        shown_a = f"{a[0]} vpp {a[1]}" if knob == "schedule" else a
        shown_v = f"{v[0]} vpp {v[1]}" if knob == "schedule" else v
        try:
            changed = _with(mine, knob, v, best)
            c = simulate_plan(changed)
            changes.append(KnobChange(knob, shown_a, shown_v, c.step_time,
                                      max(c.peak_memory) <= memory_limit))
        except (PlanError, ValueError) as exc:
            changes.append(KnobChange(knob, shown_a, shown_v, None, False, str(exc)))
    changes.sort(key=lambda c: (c.step_time is None, c.step_time or 0.0))
    fits = max(r.peak_memory) <= memory_limit
    return Rating(r.step_time, b.step_time, fits, fit_text(r.peak_memory, memory_limit), changes,
                  _together(mine, best, r.step_time, changes, memory_limit))


def _together(mine: Plan, best: Plan, step_time: float, changes: list[KnobChange],
              memory_limit: float) -> KnobChange | None:
    """The two changes that save the most, made one after the other on ``mine``."""
    saving = [c for c in changes if c.step_time is not None and c.step_time < step_time]
    if len(saving) < 2:
        return None
    first, second = saving[:2]
    knob = f"{first.knob} + {second.knob}"
    shown = (first.mine, second.mine), (first.best, second.best)
    try:
        plan = mine
        for c in (first, second):
            plan = _with(plan, c.knob, _value(best, c.knob), best)
        t = simulate_plan(plan)
    except (PlanError, ValueError) as exc:
        return KnobChange(knob, *shown, None, False, str(exc))
    return KnobChange(knob, *shown, t.step_time, max(t.peak_memory) <= memory_limit)


__all__ = ["KnobChange", "Rating", "rate_plan"]
