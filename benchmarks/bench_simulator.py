"""How fast is `pipesim.simulate`? Compute actions per second, and the ratio to a list scheduler.

The rows are a sweep of sizes, from 16 compute actions (pp 2) to about 200k (pp 64), over the
schedules with their own shapes (1F1B, GPipe, interleaved, ZB-H1/H2, ZB-V, DualPipe): the
planner calls the simulator thousands of times on small and medium schedules, so a fixed cost
per call matters as much as the cost per action. For each configuration, in one run: build +
validate the schedule (timed apart, it is not the simulator), then the best of a number of
rounds of

* ``pipesim.simulate`` then its time metrics (makespan, bubble_fraction, bubble_rate): what the
  planner and sweeps pay per call before memory ("simulate s", "sim/list");
* the same and peak memory per rank (as the planner reads them; the memory model runs on the
  engine's arrays; "+memory s", "mem/list");
* ``pipesim.simulate`` then its trace DataFrame (built on first access, as every table,
  picture and the memory model read it; "+trace s", "trace/list");
* a minimal plain-Python list scheduler that computes the same start times from the compute
  orders (checked equal), the floor any simulator of this model has to beat.

"sim <= 1.5x" is PASS where simulate + metrics takes at most 1.5 times the list scheduler
(`TARGET`), the bound the simulator is held to at every size; the last line counts the rows
that pass.

The default (async) mode runs as a dataflow without SimPy (:mod:`pipesim.sim.dataflow`).

Times are CPU seconds of this process (``time.process_time``), best of ``--repeat`` rounds times
a factor that grows as the schedule shrinks (about 65,536 compute actions' worth a round, at
most 1,000 rounds), each round timing every variant once in turn: on a shared machine that is
what one core gives, whatever else runs beside it. The header line gives the load average.

``--naive`` also times the textbook SimPy structure (one process per rank, one timeout per
compute action, one event per message) on the headline configuration, to show why the engine
makes events only where ranks interact.

    python benchmarks/bench_simulator.py            # the sweep (a minute or two)
    python benchmarks/bench_simulator.py --quick    # four small and medium configurations
"""
from __future__ import annotations

import argparse
import os
import time

import simpy

import pipesim
from pipesim import CostModel, simulate

# (schedule, pp, vpp, microbatches), by compute actions: 16 to 196,608
FULL = [
    ("1f1b", 2, 1, 4),                # 16
    ("gpipe", 4, 1, 8),               # 64
    ("interleaved", 4, 2, 8),         # 128
    ("dualpipe", 4, 1, 16),           # 138 (an overlapped pair counts as its two parts)
    ("zb-h1", 4, 1, 16),              # 192
    ("zbv", 4, 2, 16),                # 384
    ("1f1b", 8, 1, 64),               # 1,024
    ("zb-h2", 8, 1, 64),              # 1,536
    ("dualpipe", 8, 1, 128),          # 2,092
    ("1f1b", 8, 1, 256),              # 4,096
    ("interleaved", 8, 2, 128),       # 4,096
    ("zbv", 8, 2, 128),               # 6,144
    ("1f1b", 64, 1, 64),              # 8,192
    ("interleaved", 8, 2, 256),       # 8,192
    ("dualpipe", 16, 1, 256),         # 8,376
    ("zb-h1", 64, 1, 128),            # 24,576
    ("zb-h2", 32, 1, 512),            # 49,152
    ("1f1b", 64, 1, 1024),            # 131,072
    ("gpipe", 64, 1, 1024),           # 131,072
    ("interleaved", 64, 2, 512),      # 131,072: the headline target, < 2 s
    ("interleaved", 16, 4, 1024),     # 131,072
    ("interleaved", 64, 4, 256),      # 131,072
    ("zb-h1", 64, 1, 1024),           # 196,608
    ("zbv", 64, 2, 512),              # 196,608
]
QUICK = [("1f1b", 2, 1, 4), ("interleaved", 4, 2, 8), ("1f1b", 8, 1, 64), ("zbv", 8, 2, 64)]
TARGET = 1.5                          # simulate + metrics over the list scheduler, at most
ROUND_ACTIONS = 65_536                # compute actions' worth of work a row is timed over, about
MAX_ROUNDS = 1000


def costs_for(n: int) -> CostModel:
    """Distinct per-stage costs, so no coincidence of equal times hides an ordering error."""
    return CostModel(forward=[1.0 + 0.01 * (s % 7) for s in range(n)],
                     backward_input=[1.1 + 0.01 * (s % 5) for s in range(n)],
                     backward_weight=[0.9 + 0.01 * (s % 3) for s in range(n)])


def list_scheduler(schedule, times) -> dict:
    """Start time of each compute action (zero communication cost), by plain list scheduling."""
    n, pp = schedule.num_stages, schedule.pp
    orders = [schedule.compute_order(r) for r in range(pp)]
    pos = [0] * pp
    free = [0.0] * pp
    done_f: dict = {}
    done_g: dict = {}
    start: dict = {}
    last = n - 1
    pending = list(range(pp))
    while pending:
        stuck = []
        moved = False
        for r in pending:
            order, i, t = orders[r], pos[r], free[r]
            while i < len(order):
                a = order[i]
                op, s, mb = a
                if op == "F":
                    ready = 0.0 if s == 0 else done_f.get((s - 1, mb))
                elif op == "W":
                    ready = 0.0
                else:
                    ready = done_f[(s, mb)] if s == last else done_g.get((s + 1, mb))
                if ready is None:
                    break
                if ready > t:
                    t = ready
                start[a] = t
                t += times[op][s]
                if op == "F":
                    done_f[(s, mb)] = t
                elif op != "W":
                    done_g[(s, mb)] = t
                i += 1
            moved = moved or i != pos[r]
            pos[r], free[r] = i, t
            if i < len(order):
                stuck.append(r)
        if not moved:
            raise RuntimeError("list scheduler stuck")
        pending = stuck
    return start


def general_list_scheduler(schedule, times) -> dict:
    """`list_scheduler` for schedules with overlapped pairs or routes (DualPipe): an overlap's
    parts run in turn, each when its own input is there (the default
    ``CostModel.overlap_factor``), and both outputs leave when the pair ends (its sends follow
    it); a microbatch enters at its route's first stage and turns at its last. Apart, so that
    the plain one stays the floor it was."""
    n, pp, m = schedule.num_stages, schedule.pp, schedule.num_microbatches
    routes = schedule.routes or [(0, n - 1)] * m
    firsts, lasts = [r[0] for r in routes], [r[-1] for r in routes]
    orders = [schedule.compute_order(r) for r in range(pp)]
    pos, free = [0] * pp, [0.0] * pp
    done_f: dict = {}
    done_g: dict = {}
    start: dict = {}
    pending = list(range(pp))
    while pending:
        stuck = []
        moved = False
        for r in pending:
            order, i, t = orders[r], pos[r], free[r]
            while i < len(order):
                parts = order[i].parts
                readies = []
                for op, s, mb in parts:
                    if op == "F":
                        ready = 0.0 if s == firsts[mb] else done_f.get((s - 1, mb))
                    elif op == "W":
                        ready = 0.0
                    else:
                        ready = done_f.get((s, mb)) if s == lasts[mb] else done_g.get((s + 1, mb))
                    readies.append(ready)
                if None in readies:
                    break
                for part, ready in zip(parts, readies):
                    t = max(t, ready)
                    start[part] = t
                    t += times[part.op][part.stage]
                for op, s, mb in parts:
                    if op == "F":
                        done_f[(s, mb)] = t
                    elif op != "W":
                        done_g[(s, mb)] = t
                i += 1
            moved = moved or i != pos[r]
            pos[r], free[r] = i, t
            if i < len(order):
                stuck.append(r)
        if not moved:
            raise RuntimeError("list scheduler stuck")
        pending = stuck
    return start


def naive_simpy(schedule, times) -> float:
    """One timeout per compute action and one event per message: the textbook structure."""
    env = simpy.Environment()
    n, m = schedule.num_stages, schedule.num_microbatches
    msgs = [env.event() for _ in range(2 * n * m)]

    def rank(r):
        for op, s, mb in schedule.actions(r):
            if op in times:
                yield env.timeout(times[op][s])
            elif op == "SEND_F":
                msgs[(s + 1) * m + mb].succeed()
            elif op == "SEND_B":
                msgs[(n + s - 1) * m + mb].succeed()
            elif op == "RECV_F":
                yield msgs[s * m + mb]
            else:
                yield msgs[(n + s) * m + mb]

    for r in range(schedule.pp):
        env.process(rank(r))
    env.run()
    return env.now


def metrics_only(schedule, costs):
    """Simulate and read the time metrics (no trace DataFrame is built for these)."""
    r = simulate(schedule, costs)
    return r, r.makespan, r.bubble_fraction, r.bubble_rate


def with_memory(schedule, costs):
    """Simulate, read the time metrics and the peak memory of every rank."""
    r = simulate(schedule, costs)
    return r, r.makespan, r.bubble_fraction, r.bubble_rate, r.peak_memory


def with_trace(schedule, costs):
    """Simulate and build the trace DataFrame."""
    r = simulate(schedule, costs)
    r.trace
    return r


def best_of(repeat: int, fn):
    """Least CPU time of this process over ``repeat`` calls (robust to other jobs on the box)."""
    best, value = float("inf"), None
    for _ in range(repeat):
        t0 = time.process_time()
        value = fn()
        best = min(best, time.process_time() - t0)
    return best, value


def best_of_rounds(repeat: int, *fns):
    """`best_of` for several functions timed in turn, one call each per round: a slow phase of
    the machine then slows them all alike, and the ratios stay fair."""
    best, values = [float("inf")] * len(fns), [None] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            t0 = time.process_time()
            values[i] = fn()
            best[i] = min(best[i], time.process_time() - t0)
    return list(zip(best, values))


def rounds_for(actions: int, repeat: int) -> int:
    """Rounds to time a schedule of ``actions`` compute actions over: ``repeat`` for the largest,
    more for smaller ones (a small schedule takes microseconds; more rounds bring its minimum
    clear of the noise)."""
    return repeat * max(1, min(MAX_ROUNDS, ROUND_ACTIONS // max(actions, 1)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--naive", action="store_true", help="also time the naive SimPy structure")
    parser.add_argument("--check", action="store_true",
                        help=f"exit with status 1 when a row's sim/list is above {TARGET}")
    args = parser.parse_args()
    configs = QUICK if args.quick else FULL
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"CPU time of this process (time.process_time), best of the rounds; load average "
          f"{load} on {os.cpu_count()} cores; times in ms")
    print(f"{'schedule':<12}{'pp':>4}{'vpp':>4}{'m':>6}{'compute':>9}{'build+val':>10}"
          f"{'simulate':>10}{'actions/s':>11}{'+memory':>10}{'+trace':>10}{'list':>10}"
          f"{'sim/list':>9}{'mem/list':>9}{'trace/list':>11}{f'sim <= {TARGET}x':>14}")
    failed = 0
    for name, pp, vpp, m in configs:
        t0 = time.process_time()
        schedule = pipesim.build_schedule(name, pp=pp, microbatches=m, vpp=vpp).validate()
        build = time.process_time() - t0
        costs = costs_for(schedule.num_stages)
        times = costs.compute_times(schedule.num_stages)
        floor = (general_list_scheduler if schedule.has_routes or schedule.has_overlaps
                 else list_scheduler)
        (sim_s, _), (memory_s, _), (trace_s, result), (list_s, starts) = best_of_rounds(
            rounds_for(schedule.num_compute_actions, args.repeat),
            lambda: metrics_only(schedule, costs), lambda: with_memory(schedule, costs),
            lambda: with_trace(schedule, costs), lambda: floor(schedule, times))
        comp = result.trace[result.trace["kind"] == "compute"]
        got = dict(zip(zip(comp["op"].astype(str), comp["stage"], comp["microbatch"]), comp["start"]))
        bad = sum(1 for a, t in starts.items() if abs(got[tuple(a)] - t) > 1e-6 * max(1.0, t))
        if bad or len(got) != len(starts):
            raise SystemExit(f"{name}: simulate and the list scheduler disagree on {bad} start times")
        actions = len(starts)
        ok = sim_s <= TARGET * list_s
        failed += not ok
        print(f"{name:<12}{pp:>4}{vpp:>4}{m:>6}{actions:>9}{1e3 * build:>10.1f}{1e3 * sim_s:>10.3f}"
              f"{actions / sim_s:>11,.0f}{1e3 * memory_s:>10.3f}{1e3 * trace_s:>10.3f}"
              f"{1e3 * list_s:>10.3f}{sim_s / list_s:>9.2f}{memory_s / list_s:>9.2f}"
              f"{trace_s / list_s:>11.2f}{'PASS' if ok else 'FAIL':>14}")
    print(f"{len(configs) - failed} of {len(configs)} rows at sim/list <= {TARGET}")
    if args.naive:
        name, pp, vpp, m = ("interleaved", 64, 2, 512) if not args.quick else configs[-1]
        schedule = pipesim.build_schedule(name, pp=pp, microbatches=m, vpp=vpp).validate()
        costs = costs_for(schedule.num_stages)
        times = costs.compute_times(schedule.num_stages)
        naive_s, end = best_of(1, lambda: naive_simpy(schedule, times))
        sim_s, result = best_of(args.repeat, lambda: simulate(schedule, costs))
        assert abs(end - result.makespan) < 1e-6 * end, (end, result.makespan)
        print(f"\nnaive SimPy (a timeout per action) on {name} pp={pp} vpp={vpp} m={m}: "
              f"{naive_s:.3f} s vs pipesim.simulate {sim_s:.3f} s ({naive_s / sim_s:.1f}x)")
    if args.check and failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
