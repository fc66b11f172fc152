"""The Zero Bubble paper's own heuristic (Qi et al., ICLR 2024, "Zero Bubble Pipeline
Parallelism", section 3.1), as a source of zb-auto candidates at one stage per rank.

`pipesim.zb_auto.search.greedy_order` list-schedules every rank in time order; the paper sweeps
the microbatches instead, one at a time across all stages, and this is what reaches its ZB-2p
column when W is cheaper than F (ZB-H2's hand-made order then leaves ~7% bubble, this one <1%):

* warm-up: each stage runs as many forwards before its first backward as fill the time until
  that backward's gradient can arrive (computed from the last stage back), within the memory
  limit, never more than the stage before it;
* steady state: per microbatch, one F on every stage (top down) then one I on every stage
  (bottom up), each preceded by the W passes that fit before its input arrives, or that the
  memory limit needs, or that a gap smaller than the worst stage's bubble so far may take;
* ``prioritize_i`` lets a stage that is two forwards ahead of the next skip its forward when
  that causes no bubble downstream;
* the remaining W passes run at the end.

The times it computes are the simulator's in ``async`` mode (each pass starts when its rank and
its input are free; a transfer costs the link's ``transfer_time``); the orders are simulated by
the caller anyway, and kept only if they fit.
"""
from __future__ import annotations

from collections.abc import Sequence
from itertools import product

from ..errors import ScheduleError
from ..schedule.action import F, I, W, Action

SWEEP_VARIANTS = tuple(product((True, False), (True, False), (True, False)))


class SweepStuck(ScheduleError):
    """The sweep cannot free memory for its next pass under the limit."""


def sweep_order(pp: int, m: int, tf: Sequence[float], ti: Sequence[float], tw: Sequence[float],
                comm: Sequence[float], act: Sequence[float], keep: Sequence[float],
                static: Sequence[float], limits: Sequence[float], *, bubble_before_first_i: bool,
                prioritize_i: bool, greedy_fill: bool) -> list[list[Action]]:
    """Per rank (= stage), the F / I / W order of one variant of the paper's sweep.

    ``comm[s]``: the transfer time between stage s and s + 1; ``act[s]``: the bytes an F holds,
    ``keep[s]`` of which stay from its I to its W; ``static[r]``: bytes held throughout."""
    n = pp
    cost = {F: tf, I: ti, W: tw}
    count = {F: [0] * n, I: [0] * n, W: [0] * n}
    done = {F: [[0.0] * m for _ in range(n)], I: [[0.0] * m for _ in range(n)]}
    end = [0.0] * n
    mem = list(static)
    bubble = [0.0] * n
    orders: list[list[Action]] = [[] for _ in range(n)]

    def arrival(op: str, s: int, k: int) -> float:
        if op == F:
            return done[F][s - 1][k] + comm[s - 1] if s > 0 else 0.0
        return done[I][s + 1][k] + comm[s] if s < n - 1 else done[F][s][k]

    def put(s: int, op: str) -> None:
        k = count[op][s]
        c = cost[op][s]
        t = end[s] + c
        if op != W:
            t = max(t, arrival(op, s, k) + c)
        if count[F][s]:
            bubble[s] += t - (end[s] + c)
        end[s] = t
        if op != W:
            done[op][s][k] = t
        mem[s] += act[s] if op == F else -(act[s] - keep[s]) if op == I else -keep[s]
        count[op][s] += 1
        orders[s].append(Action(op, s, k))

    def free_for(s: int, need: float) -> None:
        while mem[s] + need > limits[s] * (1 + 1e-12):
            if count[W][s] >= count[I][s]:
                raise SweepStuck(f"stage {s}: no W left to free memory under {limits[s]:g}")
            put(s, W)

    def fill_before(s: int, ready: float) -> None:
        """W passes that fit before ``ready`` (an input's arrival), and maybe one that does not."""
        while count[W][s] < count[I][s] and end[s] + tw[s] <= ready:
            put(s, W)
        if count[W][s] < count[I][s] and end[s] < ready:
            if ready - end[s] > max(bubble) - bubble[s] or greedy_fill:
                put(s, W)

    for i in range(m):
        if i == 0:
            for s in range(n):
                free_for(s, act[s])
                put(s, F)
            extra = [0] * n
            last_t = done[F][n - 1][0] + ti[n - 1]
            for s in range(n - 2, -1, -1):
                held, t = mem[s], end[s]
                while count[F][s] + extra[s] < m and held + act[s] <= limits[s] * (1 + 1e-12):
                    if bubble_before_first_i:
                        if t + tf[s] > last_t + comm[s]:
                            break
                    elif t >= last_t + comm[s]:
                        break
                    held += act[s]
                    t += tf[s]
                    extra[s] += 1
                last_t = max(t, last_t + comm[s]) + ti[s]
            for s in range(1, n):
                while extra[s] > 0 and extra[s] >= extra[s - 1] and count[F][s] + extra[s] < m:
                    extra[s] -= 1
            for s in range(n):
                for _ in range(extra[s]):
                    put(s, F)
            for s in range(n - 1, -1, -1):
                put(s, I)
            continue
        want = [0] * n
        for s in range(n):
            if count[F][s] >= m:
                continue
            if prioritize_i and s + 1 < n and count[F][s] >= count[F][s + 1] + 2:
                nxt = end[s + 1] + tf[s + 1] + ti[s + 1] + comm[s]
                if end[s] >= nxt:
                    continue
                w_cost, w_cnt, held = 0.0, 0, mem[s] + act[s]
                while held > limits[s] and count[W][s] + w_cnt < count[I][s]:
                    w_cost += tw[s]
                    held -= keep[s]
                    w_cnt += 1
                if end[s] + tf[s] + w_cost > nxt and nxt - end[s] <= max(bubble) - bubble[s]:
                    continue
            want[s] = 1
        for s in range(n - 2, -1, -1):
            want[s] = min(want[s], want[s + 1])
        for s in range(n):
            if not want[s]:
                continue
            free_for(s, act[s])
            if s > 0:
                fill_before(s, arrival(F, s, count[F][s]))
            put(s, F)
        for s in range(n - 1, -1, -1):
            if s + 1 < n:
                fill_before(s, arrival(I, s, i))
            if s == 0 and count[F][s] == m:
                while count[W][s] < count[I][s]:
                    put(s, W)
            put(s, I)
    for s in range(n):
        while count[W][s] < m:
            put(s, W)
    return orders
