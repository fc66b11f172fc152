"""How fast is `pipesim plan`? Plans per second with 1 worker and with every core, same search.

For one search (default: Llama-3 8B on 64 H100s, gbs 256, every schedule), in one run:

* wall seconds and plans evaluated (enumerated) per second with ``workers=1`` (in this
  process) and with ``workers=K`` (a process pool over every core), the scaling ratio, and a
  check that both rank the same plans;
* where the CPU time goes (summed over the workers): enumeration, cost derivation
  (``plan.derive()``), the bounds (pruning) and the discrete-event simulations.

``--big`` then runs the headline search, Llama-3 70B on 1024 H100s at gbs 1024 over every
schedule, with every core, and prints how long it took and how many plans it simulated;
``--huge`` the largest, Llama-3 405B on 16384 H100s at gbs 2048 and sequence 8192, with 1
worker and with every core. Each prints its wall and CPU seconds (this process and its
workers, user + system), the largest resident set of any of them and the load average, as
`pipesim plan` runs it (the CLI adds its explain and robustness steps).

    python benchmarks/bench_planner.py            # the 1-vs-K comparison (about a minute)
    python benchmarks/bench_planner.py --big      # and the 1024-GPU search
    python benchmarks/bench_planner.py --huge     # and the 16384-GPU search, 1 and K workers
"""
from __future__ import annotations

import argparse
import os
import resource
import time

from pipesim.planner import SearchSpace, search
from pipesim.planner.search import default_workers


def _cpu() -> float:
    """User + system seconds of this process and of its reaped workers."""
    return sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF,
                                                              resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))


def run(space: SearchSpace, workers: int):
    t0 = time.perf_counter()
    result = search(space, workers=workers)
    return time.perf_counter() - t0, result


def costed(space: SearchSpace, workers: int) -> str:
    """One search: wall, CPU, the largest resident set (MB) so far, the load average."""
    cpu0 = _cpu()
    wall, res = run(space, workers)
    rss = max(resource.getrusage(w).ru_maxrss for w in (resource.RUSAGE_SELF,
                                                         resource.RUSAGE_CHILDREN)) / 1024
    best = res.ranked.iloc[0]
    return (f"{workers} worker(s): wall {wall:.1f} s, CPU {_cpu() - cpu0:.1f} s, max RSS "
            f"{rss:.0f} MB, load {os.getloadavg()[0]:.1f}; {len(res.rows):,} plans, "
            f"{res.simulated} simulated; best {best['key']} {best['step_time']:.3f} s")


def shares(result) -> str:
    t = result.timing
    parts = {"enumerate": t["enumerate"], "derive": t["derive"], "bounds (pruning)": t["bounds"],
             "simulate": t["simulate"]}
    total = sum(parts.values())
    return ", ".join(f"{k} {v / total:.0%}" for k, v in parts.items()) + f" of {total:.1f} CPU s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--gpus", type=int, default=64)
    parser.add_argument("--gbs", type=int, default=256)
    parser.add_argument("--workers", type=int, default=default_workers())
    parser.add_argument("--big", action="store_true", help="also the 70B / 1024-GPU search")
    parser.add_argument("--huge", action="store_true",
                        help="also the 405B / 16384-GPU search, 1 and --workers workers")
    args = parser.parse_args()
    space = SearchSpace(args.model, gpus=args.gpus, gbs=args.gbs)
    print(f"search: {args.model} on {args.gpus} x H100, gbs {args.gbs}, every schedule")
    print(f"{'workers':>7} {'wall s':>8} {'plans':>6} {'simulated':>9} {'plans/s':>8} "
          f"{'simulated/s':>11}  CPU time")
    walls = {}
    results = {}
    for k in sorted({1, args.workers}):
        wall, res = run(space, k)
        walls[k], results[k] = wall, res
        print(f"{k:>7} {wall:>8.2f} {len(res.rows):>6} {res.simulated:>9} "
              f"{len(res.rows) / wall:>8.0f} {res.simulated / wall:>11.1f}  {shares(res)}")
    if args.workers > 1:
        a, b = results[1].ranked, results[args.workers].ranked
        same = list(a["key"][:10]) == list(b["key"][:10])
        print(f"scaling 1 -> {args.workers} workers: {walls[1] / walls[args.workers]:.2f}x "
              f"(same top 10: {same})")
    if args.big:
        big = SearchSpace("llama3-70b", gpus=1024, gbs=1024)
        wall, res = run(big, args.workers)
        best = res.ranked.iloc[0]
        print(f"\nllama3-70b on 1024 x H100, gbs 1024, every schedule, {args.workers} workers: "
              f"{wall:.0f} s, {len(res.rows)} plans enumerated, {res.simulated} simulated, "
              f"{res.counts()}; best {best['key']} {best['step_time']:.3f} s "
              f"({best['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, MFU {best['mfu']:.1%})")
        print(f"CPU time: {shares(res)}")
    if args.huge:
        huge = SearchSpace("llama3-405b", gpus=16384, gbs=2048, seq_length=8192)
        print("\nllama3-405b on 16384 x H100, gbs 2048, seq 8192, every schedule:")
        for k in sorted({1, args.workers}):
            print("  " + costed(huge, k))


if __name__ == "__main__":
    main()
