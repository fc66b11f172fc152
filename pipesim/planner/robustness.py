"""Is the ranking robust to the cost model's own uncertainty? Re-rank the top plans under it.

Why: the per-operator model's efficiencies are fitted (A100) or carried over (other GPUs), and
link figures are datasheet peaks; a 2% lead between two plans can be inside that error. Each
scenario scales every efficiency figure of the hardware (GEMM, element-wise, attention) by
``1 +- efficiency`` and every link bandwidth (a hardware file's per-collective ones too) by
``1 +- links`` (the four corners), re-simulates the top plans and compares their order with
the nominal one; the report names the scenarios in which the winner or the order changes.
Unlike :mod:`pipesim.planner.stability`'s jitter (per-action noise), these errors are
systematic: they move every action of a plan alike.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..plan.plan import Plan
from ..sim.plan_report import simulate_plan


def scaled(plan: Plan, eff: float, link: float) -> Plan:
    """``plan`` on its hardware with efficiencies times ``eff`` (at most 1), links times ``link``."""
    hw = plan.cluster.hardware
    hw = hw.with_links_scaled(link).with_(gemm_e_max=min(1.0, hw.gemm_e_max * eff),
                                          mem_efficiency=min(1.0, hw.mem_efficiency * eff),
                                          flash_e_max=min(1.0, hw.flash_e_max * eff))
    c = plan.cluster
    changes = {f: getattr(c, f) * link for f in ("intra_bandwidth", "inter_bandwidth")
               if getattr(c, f) is not None}
    return plan.with_(cluster=c.with_(hardware=hw, **changes))


@dataclass(frozen=True)
class RobustnessReport:
    keys: list[str]                       # nominal order, best first
    efficiency: float
    links: float
    scenarios: list[tuple[float, float]]  # (efficiency factor, link factor)
    step_times: list[list[float]]         # per scenario, per plan (keys' order)

    def _order(self, times: list[float]) -> list[int]:
        return sorted(range(len(times)), key=lambda i: (times[i], i))

    @property
    def unstable(self) -> list[tuple[tuple[float, float], list[str]]]:
        """Scenarios whose order differs from the nominal one, with their order."""
        out = []
        for sc, times in zip(self.scenarios, self.step_times):
            order = self._order(times)
            if order != list(range(len(times))):
                out.append((sc, [self.keys[i] for i in order]))
        return out

    @property
    def winner_stable(self) -> bool:
        return all(self._order(t)[0] == 0 for t in self.step_times)

    def text(self) -> str:
        head = (f"robustness: the top {len(self.keys)} plans under efficiency +-{self.efficiency:.0%}"
                f" and links +-{self.links:.0%} ({len(self.scenarios)} scenarios): ")
        if not self.unstable:
            return head + "the order holds in every one"
        lines = [head + ("the winner holds, the order does not" if self.winner_stable
                         else "NOT stable: the winner changes")]
        for (e, l), order in self.unstable:
            lines.append(f"  efficiency x{e:g}, links x{l:g}: {' < '.join(order)}")
        return "\n".join(lines)


def robustness_check(plans: list[Plan], keys: list[str], efficiency: float = 0.10,
                     links: float = 0.20) -> RobustnessReport:
    """``plans`` in their nominal order (best first); see the module docstring."""
    if not 0 <= efficiency < 1 or not 0 <= links < 1:
        raise ValueError(f"efficiency and links uncertainties must be in [0, 1), got "
                         f"{efficiency}, {links}")
    scenarios = [(1 + se * efficiency, 1 + sl * links) for se in (-1, 1) for sl in (-1, 1)]
    times = [[simulate_plan(scaled(p, e, l), validate=False).step_time for p in plans]
             for e, l in scenarios]
    return RobustnessReport(list(keys), efficiency, links, scenarios, times)
