"""Measured vs fitted collective times over gloo on this machine, in one run.

``pipeexec calibrate-hardware`` stores per-collective alpha-beta figures (all-reduce,
reduce-scatter, all-gather, all-to-all; per group size) fitted to a gloo benchmark
(`pipeexec.measuring.collectives`); a plan's tensor-parallel, ZeRO and expert-parallel
collectives are then priced with them (`pipesim.plan.collectives`). This script runs the same
benchmark and prints, per collective, per p, per size: the measured time (median repeat, and
the repeats' quartiles: the machine's noise), the fit's time and their ratio, side by side; then
each fit's latency and bandwidth with its median and worst error, the message sizes the
executor's runs send (inside the sweep, or flagged), and one summary line (median and worst
fit error over every point).

    python benchmarks/bench_collectives.py                       # p 2 and 4, 4 KiB-32 MiB
    python benchmarks/bench_collectives.py --groups 2 --sizes 4KiB,1MiB --repeats 5
    python benchmarks/bench_collectives.py --out /tmp/coll.json  # every sample, and the fits

Mind the machine: ``p`` ranks share the CPU cores (more ranks than cores time-share), and on a
shared VM other load and steal time spread the repeats; the quartiles show by how much.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from pipesim.plan.collectives import COLLECTIVES
from pipesim.units import format_bytes, parse_bytes

from pipeexec.measuring.collectives import (GROUPS, SIZES, CollectiveBenchmarkError, benchmark,
                                           run_message_sizes)


def run_sizes() -> dict[str, float]:
    """The collective messages of the executor's runs on this machine: the tiny GPT of
    ``pipeexec train``'s default, and compare's default model at tp 2 x pp 2 and at dp 4."""
    from pipeexec.cli.compare import default_plan
    from pipeexec.config import DEFAULT_PLAN

    compare = default_plan()
    out = {}
    for label, plan in (("tiny GPT", DEFAULT_PLAN), ("compare tp2 pp2", compare.with_(tp=2, pp=2)),
                        ("compare dp4", compare.with_(dp=4))):
        for what, nbytes in run_message_sizes(plan).items():
            out[f"{label}: {what}"] = nbytes
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", default=",".join(map(str, GROUPS)),
                    help="group sizes p (ranks), comma-separated")
    ap.add_argument("--sizes", default=",".join(format_bytes(s).replace(" ", "") for s in SIZES),
                    help="message sizes with units, comma-separated")
    ap.add_argument("--collectives", default=",".join(COLLECTIVES))
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds any one wait may take")
    ap.add_argument("--out", default=None, metavar="FILE.json", help="write every sample and fit")
    ns = ap.parse_args(argv)
    try:
        groups = tuple(int(g) for g in ns.groups.replace(" ", ",").split(",") if g)
        sizes = tuple(int(parse_bytes(s)) for s in ns.sizes.replace(" ", ",").split(",") if s)
    except ValueError as exc:
        ap.error(str(exc))
    names = tuple(n for n in ns.collectives.replace(" ", ",").split(",") if n)
    load0 = os.getloadavg()[0]
    started = time.monotonic()
    try:
        b = benchmark(groups, sizes, names, warmup=ns.warmup, repeats=ns.repeats,
                      timeout=ns.timeout)
    except (CollectiveBenchmarkError, ValueError) as exc:
        print(f"bench_collectives: {exc}", file=sys.stderr)
        return 1
    took = time.monotonic() - started
    print(f"gloo collectives on {os.cpu_count()} cores, load {load0:.2f} -> "
          f"{os.getloadavg()[0]:.2f}, {ns.repeats} repeats (median) after {ns.warmup} warm-up, "
          f"{took:.0f} s")
    print(f"{'collective':<15} {'p':>2} {'size':>10} {'measured ms':>12} {'q1-q3 ms':>15} "
          f"{'fit ms':>9} {'fit/meas':>9}")
    timings = {(t.name, t.p, t.nbytes): t for t in b.timings}
    for name, p, nbytes, measured, fitted, ratio in b.rows():
        q = statistics.quantiles(timings[name, p, nbytes].samples, n=4) \
            if ns.repeats >= 2 else (measured, measured, measured)
        print(f"{name:<15} {p:>2} {format_bytes(nbytes):>10} {measured * 1e3:>12.3f} "
              f"{f'{q[0] * 1e3:.3f}-{q[2] * 1e3:.3f}':>15} {fitted * 1e3:>9.3f} {ratio:>9.3f}")
    print()
    print(f"{'collective':<15} {'p':>2} {'latency us':>11} {'bandwidth GB/s':>15} "
          f"{'median err':>11} {'worst err':>10}")
    for f in b.fits:
        err = b.errors(f.name, f.p)
        print(f"{f.name:<15} {f.p:>2} {f.latency * 1e6:>11.1f} {f.bandwidth / 1e9:>15.3f} "
              f"{statistics.median(err):>11.1%} {max(err):>10.1%}")
    print()
    lo, hi = min(sizes), max(sizes)
    for label, nbytes in run_sizes().items():
        where = "inside the sweep" if lo <= nbytes <= hi else "OUTSIDE the sweep"
        print(f"run message {label}: {format_bytes(nbytes)} ({where})")
    rows = b.rows()
    err = [abs(r[-1] - 1) for r in rows]
    worst = max(rows, key=lambda r: abs(r[-1] - 1))
    print(f"summary: {len(rows)} points, fit error median {statistics.median(err):.1%}, worst "
          f"{max(err):.1%} ({worst[0]} p={worst[1]} {format_bytes(worst[2])})")
    if ns.out:
        Path(ns.out).write_text(json.dumps({
            "timings": [{"collective": t.name, "p": t.p, "bytes": t.nbytes, "seconds": t.seconds,
                         "samples": list(t.samples)} for t in b.timings],
            "fits": [{"collective": f.name, "p": f.p, "latency": f.latency,
                      "bandwidth": f.bandwidth} for f in b.fits]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
