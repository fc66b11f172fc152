"""Deriving a plan's costs next to simulating it: Llama-3 70B, pp = 16, vpp = 5, m = 128.

    python3 benchmarks/plan_speed.py

Prints the median of several runs of ``plan.costs()`` and of ``pipesim.simulate(plan)``
(building the schedule, simulating it, the memory timeline) and their ratio.
"""
from __future__ import annotations

import statistics
import time

import pipesim


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    plan = pipesim.Plan.create("llama3-70b", "H100", schedule="interleaved", tp=8, pp=16, vpp=5,
                               dp=2, sequence_parallel=True, zero=1, recompute="selective",
                               global_batch_size=256).validate()
    assert plan.microbatches == 128
    derive = timed(plan.costs, 20)
    simulate = timed(lambda: pipesim.simulate(plan, validate=False).peak_memory, 3)
    print(plan)
    print(f"derive costs  {derive * 1e3:9.2f} ms")
    print(f"simulate      {simulate * 1e3:9.2f} ms")
    print(f"ratio         {simulate / derive:9.0f}x")


if __name__ == "__main__":
    main()
