"""Is the ranking stable to small noise? Re-simulate the top plans with jittered compute times.

Each of ``seeds`` runs multiplies every compute time of every top plan by a factor drawn
uniformly from ``[1 - jitter, 1 + jitter]`` (:func:`pipesim.simulate`'s ``jitter``), recomputes
the step times, and compares the order with the noiseless one: how many runs keep the winner
first and the whole order, and the Kendall rank correlation of each run.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..plan.plan import Plan
from ..sim.plan_report import simulate_plan


@dataclass(frozen=True)
class JitterReport:
    keys: list[str]                  # the plans, in the noiseless order
    jitter: float
    step_times: list[list[float]]    # per seed, per plan (same order as keys)
    winner_kept: int                 # seeds where the noiseless winner is still first
    order_kept: int                  # seeds where the whole order holds
    kendall_tau: list[float]         # per seed

    @property
    def seeds(self) -> int:
        return len(self.step_times)

    def text(self) -> str:
        worst = min(self.kendall_tau) if self.kendall_tau else 1.0
        verdict = "holds" if self.order_kept == self.seeds else (
            "winner holds, order changes" if self.winner_kept == self.seeds else "changes")
        return (f"jitter +-{self.jitter:.0%} on the top {len(self.keys)} plans, {self.seeds} "
                f"seeds: order {verdict} (winner first in {self.winner_kept}/{self.seeds}, whole "
                f"order in {self.order_kept}/{self.seeds}, Kendall tau >= {worst:.2f})")


def jittered_step_time(plan: Plan, jitter: float, seed: int) -> float:
    return simulate_plan(plan, validate=False, jitter=jitter, seed=seed).step_time


def jitter_check(plans: list[Plan], keys: list[str], jitter: float = 0.05, seeds: int = 5
                 ) -> JitterReport:
    """``plans`` in their noiseless order (best first). Plans whose noiseless step times are
    equal (e.g. selective recomputation with flash attention, which recomputes nothing) are
    ties: any order between them holds."""
    if not 0 < jitter < 1:
        raise ValueError(f"jitter must be in (0, 1), got {jitter}")
    base = [jittered_step_time(p, 0.0, 0) for p in plans]
    pairs = [(i, j) for i in range(len(base)) for j in range(i + 1, len(base))
             if base[i] < base[j] * (1 - 1e-12)]
    runs, winner, order, taus = [], 0, 0, []
    for seed in range(seeds):
        times = [jittered_step_time(p, jitter, seed) for p in plans]
        runs.append(times)
        agree = sum(1 if times[i] < times[j] else -1 if times[i] > times[j] else 0
                    for i, j in pairs)
        taus.append(agree / len(pairs) if pairs else 1.0)
        order += agree == len(pairs)
        first = [k for k in range(len(base)) if base[k] <= base[0] * (1 + 1e-12)]
        winner += min(range(len(times)), key=times.__getitem__) in first
    return JitterReport(list(keys), jitter, runs, winner, order, taus)
