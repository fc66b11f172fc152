"""How fast is `pipesim.simulate`? Compute actions per second, and the ratio to a list scheduler.

For each configuration, in one run: build + validate the schedule (timed apart, it is not the
simulator), then the best of ``--repeat`` runs of

* ``pipesim.simulate`` then its time metrics (makespan, bubble_fraction, bubble_rate): what the
  planner and sweeps pay per call before memory ("simulate s", "sim/list");
* the same and peak memory per rank (as the planner reads them; the memory model runs on the
  engine's arrays; "+memory s", "mem/list");
* ``pipesim.simulate`` then its trace DataFrame (built on first access, as every table,
  picture and the memory model read it; "+trace s", "trace/list");
* a minimal plain-Python list scheduler that computes the same start times from the compute
  orders (checked equal), the floor any simulator of this model has to beat.

The default (async) mode runs as a dataflow without SimPy (:mod:`pipesim.sim.dataflow`).

Times are CPU seconds of this process (``time.process_time``), best of ``--repeat`` rounds (50 times
that for schedules under 4,096 microbatch-stages), each round timing every variant once in
turn: on a shared machine that is what one core gives, whatever else runs beside it.

``--naive`` also times the textbook SimPy structure (one process per rank, one timeout per
compute action, one event per message) on the headline configuration, to show why the engine
makes events only where ranks interact.

    python benchmarks/bench_simulator.py            # the full table (about a minute)
    python benchmarks/bench_simulator.py --quick    # small configurations only
"""
from __future__ import annotations

import argparse
import time

import simpy

import pipesim
from pipesim import CostModel, simulate

# (schedule, pp, vpp, microbatches)
FULL = [
    ("1f1b", 8, 1, 64),
    ("1f1b", 64, 1, 1024),
    ("gpipe", 64, 1, 1024),
    ("interleaved", 64, 2, 512),      # the headline target: < 2 s
    ("interleaved", 16, 4, 1024),
    ("interleaved", 64, 4, 256),
    ("zb-h1", 64, 1, 1024),
    ("zb-h2", 32, 1, 512),
    ("zbv", 64, 2, 512),
]
QUICK = [("1f1b", 8, 1, 64), ("interleaved", 16, 2, 64), ("zbv", 8, 2, 64)]


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--naive", action="store_true", help="also time the naive SimPy structure")
    args = parser.parse_args()
    configs = QUICK if args.quick else FULL
    print(f"{'schedule':<12}{'pp':>4}{'vpp':>4}{'m':>6}{'compute':>9}{'build+val s':>12}"
          f"{'simulate s':>11}{'actions/s':>11}{'+memory s':>10}{'+trace s':>9}{'list s':>8}"
          f"{'sim/list':>9}{'mem/list':>9}{'trace/list':>11}")
    for name, pp, vpp, m in configs:
        t0 = time.process_time()
        schedule = pipesim.build_schedule(name, pp=pp, microbatches=m, vpp=vpp).validate()
        build = time.process_time() - t0
        costs = costs_for(schedule.num_stages)
        times = costs.compute_times(schedule.num_stages)
        # a small schedule takes milliseconds: more repeats, for a minimum clear of the noise
        repeat = args.repeat if schedule.num_microbatches * schedule.pp > 4096 else 50 * args.repeat
        (sim_s, _), (memory_s, _), (trace_s, result), (list_s, starts) = best_of_rounds(
            repeat, lambda: metrics_only(schedule, costs), lambda: with_memory(schedule, costs),
            lambda: with_trace(schedule, costs), lambda: list_scheduler(schedule, times))
        comp = result.trace[result.trace["kind"] == "compute"]
        got = dict(zip(zip(comp["op"].astype(str), comp["stage"], comp["microbatch"]), comp["start"]))
        bad = sum(1 for a, t in starts.items() if abs(got[tuple(a)] - t) > 1e-6 * max(1.0, t))
        if bad or len(got) != len(starts):
            raise SystemExit(f"{name}: simulate and the list scheduler disagree on {bad} start times")
        actions = len(starts)
        print(f"{name:<12}{pp:>4}{vpp:>4}{m:>6}{actions:>9}{build:>12.2f}{sim_s:>11.4f}"
              f"{actions / sim_s:>11,.0f}{memory_s:>10.4f}{trace_s:>9.4f}{list_s:>8.4f}"
              f"{sim_s / list_s:>9.2f}{memory_s / list_s:>9.2f}{trace_s / list_s:>11.2f}")
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


if __name__ == "__main__":
    main()
