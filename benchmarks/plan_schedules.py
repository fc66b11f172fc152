"""Schedules on a real plan: Llama-3 70B on 256 H100s (tp 8 + SP, pp 4, dp 8, distributed
optimizer, selective recomputation, global batch 512 x 8192 tokens), simulated.

    python3 benchmarks/plan_schedules.py
"""
from __future__ import annotations

import pipesim
from pipesim.units import GiB


def rows():
    base = dict(tp=8, pp=4, dp=8, sequence_parallel=True, zero=1, recompute="selective",
                global_batch_size=512)
    for schedule, vpp in (("gpipe", 1), ("1f1b", 1), ("interleaved", 5), ("zb-h1", 1),
                          ("zb-h2", 1), ("zbv", 2)):
        plan = pipesim.Plan.create("llama3-70b", "H100", schedule=schedule, vpp=vpp, **base)
        r = pipesim.simulate(plan)
        yield schedule, vpp, r


def main() -> None:
    print(repr(pipesim.Plan.create("llama3-70b", "H100", tp=8, pp=4, dp=8, sequence_parallel=True,
                                   zero=1, recompute="selective", global_batch_size=512)))
    print("| schedule | vpp | step (s) | tokens/s/GPU | MFU | bubble_fraction | peak memory, max rank (GiB) | fits 80 GB |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for schedule, vpp, r in rows():
        print(f"| {schedule} | {vpp} | {r.step_time:.2f} | {r.tokens_per_s_per_gpu:,.0f} | "
              f"{r.mfu:.1%} | {r.sim.bubble_fraction:.4f} | {max(r.peak_memory) / GiB:.1f} | "
              f"{'yes' if r.fits else 'no: ' + r.fit_message.split(' (')[0]} |")


if __name__ == "__main__":
    main()
