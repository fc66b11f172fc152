"""The README's schedules table: every registered schedule simulated on one config.

Uniform stages, zero communication, pp=4, m=8, vpp=2 where the schedule takes several chunks.
The model is the same whatever vpp: each rank's share costs F = 1, I = W = 1 (B = 2) and holds 1
byte of activations per microbatch, split evenly over its vpp chunks (W keeps half after I).
Prints markdown. Deterministic: the simulator has no noise unless asked.

    python benchmarks/schedules_table.py [--pp 4] [--microbatches 8]
"""
from __future__ import annotations

import argparse

import pipesim
from pipesim import ScheduleError

CONSTRAINTS = {  # in short; `pipesim list` has the full text
    "gpipe": "vpp = 1",
    "1f1b": "vpp = 1",
    "looped-bfs": "any vpp",
    "interleaved": "m ≥ p; m % g = 0 or ≥ p (g = pp by default)",
    "zb-h1": "vpp = 1",
    "zb-h2": "vpp = 1",
    "zbv": "vpp = 2",
    "dualpipev": "vpp = 2, m ≥ 2p",
    "dualpipe": "p even, m even ≥ 2p; vpp = 1 (each rank holds a second copy)",
    "v-half": "vpp = 2",
    "v-min": "vpp = 2",
    "zb-auto": "vpp = 1 or 2 (looped or V); costs, memory_limit (here p: ZB-1p)",
}
FORMULAS = {  # bubble_fraction (Megatron: idle / ideal compute) on uniform stages, m large enough
    "gpipe": "(p-1)/m",
    "1f1b": "(p-1)/m",
    "looped-bfs": "(p-1)/(v·m)",
    "interleaved": "(p-1)/(v·m)",
    "zb-h1": "(p-1)(F+I-W) idle per rank",
    "zb-h2": "(p-1)(F+I-2W) idle on rank 0 (m ≥ 2p-1)",
    "zbv": "0 idle inside each rank's span when F=I=W (m ≥ 2p-1)",
    "dualpipev": "(p-1)(F&B+B-3W) idle, worst rank (F = I, W ≤ I, F&B = F+B here)",
    "dualpipe": "(p/2-1)(F&B+B-3W) idle, worst rank; 2x parameters; p+1 activations",
    "v-half": "between ZB-V and 1F1B; floor(p/2)+1 activations",
    "v-min": "between ZB-V and 1F1B; floor((p+1)/3)+1 activations",
    "zb-auto": "searched: the best order found under the limit",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--microbatches", type=int, default=8)
    args = ap.parse_args()
    p, m = args.pp, args.microbatches
    print(f"simulated: pp={p}, m={m}, per rank F = I = W = 1 (B = 2) split over its chunks, "
          "no communication cost\n")
    print("| schedule | placement | constraints | bubble formula | vpp | makespan | bubble_fraction "
          "| bubble_rate | peak in-flight, rank 0 (stage, microbatch) pairs | peak activations, max rank (1 = one rank-microbatch) |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|")
    for name in pipesim.schedule_names():
        info = pipesim.schedule_info(name)
        for vpp in (2, 1):
            c = 1.0 / vpp
            costs = pipesim.CostModel.uniform(forward=c, backward_input=c, backward_weight=c,
                                              activation_bytes=c, weight_grad_fraction=0.5)
            # zb-auto searches with these costs under ZB-1p's budget: p microbatches of a rank
            options = {"costs": costs, "memory_limit": float(p)} if name == "zb-auto" else {}
            try:
                s = pipesim.build_schedule(name, pp=p, microbatches=m, vpp=vpp, **options)
                break
            except ScheduleError:
                continue
        r = pipesim.simulate(s, costs)
        print(f"| {name} | {s.placement_kind} | {CONSTRAINTS.get(name, info.constraints)} | {FORMULAS.get(name, '')} | {vpp} "
              f"| {r.makespan:g} | {r.bubble_fraction:.4f} | {r.bubble_rate:.4f} "
              f"| {r.peak_inflight[0]} | {max(r.peak_memory):g} |")


if __name__ == "__main__":
    main()
