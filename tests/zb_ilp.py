"""The exact optimum of a small one-chunk-per-rank schedule under a memory limit, as a MILP
(Zero Bubble, Qi et al. 2024, section 3.1: the ILP formulation), solved by HiGHS through
scipy.optimize.milp.

Nodes: F, I, W of every (stage = rank, microbatch). Start times S >= 0 and the makespan T are
continuous; for two nodes on one rank that no dependency orders, a binary y says which runs
first (big-M disjunction). Fixed precedences: F(s,k) after F(s-1,k) plus the transfer; I(s,k)
after I(s+1,k) plus the transfer (after F(s,k) on the last stage); W(s,k) after I(s,k); each op
of a stage in microbatch order (as the heuristic and the handcrafted schedules). Memory is
checked at the start of every F (the only allocation, when no gradient buffers are counted):
static + activations of the F's before and including it - what the I's and W's before it freed
<= the limit. Transfers are not queued on links here, so with communication the optimum is a
lower bound of what the simulator can reach; with none it is exact.
"""
from __future__ import annotations

import numpy as np

import pipesim
from pipesim import Action


def optimal_schedule(pp: int, m: int, costs: pipesim.CostModel, memory_limit: float,
                     time_limit: float = 60.0) -> tuple[float, pipesim.Schedule]:
    from scipy.optimize import Bounds, LinearConstraint, milp

    t = costs.compute_times(pp)
    comm = [costs.transfer_time(x) for x in costs.stage_values("p2p_bytes", pp)]
    act = costs.stage_values("activation_bytes", pp)
    keep = [f * a for f, a in zip(costs.stage_values("weight_grad_fraction", pp), act)]
    static = [a + b for a, b in zip(costs.rank_static_bytes(pp), costs.stage_values("stage_static_bytes", pp))]
    nodes = [(op, s, k) for s in range(pp) for op in "FIW" for k in range(m)]
    index = {n: i for i, n in enumerate(nodes)}
    dur = np.array([t[op][s] for op, s, k in nodes])
    preds: dict[int, list[tuple[int, float]]] = {i: [] for i in range(len(nodes))}
    for op, s, k in nodes:
        me = index[(op, s, k)]
        if k > 0:
            preds[me].append((index[(op, s, k - 1)], 0.0))
        if op == "F" and s > 0:
            preds[me].append((index[("F", s - 1, k)], comm[s - 1]))
        if op == "I":
            preds[me].append((index[("I", s + 1, k)], comm[s]) if s < pp - 1 else (index[("F", s, k)], 0.0))
            preds[me].append((index[("F", s, k)], 0.0))
        if op == "W":
            preds[me].append((index[("I", s, k)], 0.0))
    n = len(nodes)
    reach = np.zeros((n, n), dtype=bool)          # reach[a, b]: a must run before b
    for b in range(n):
        stack = [a for a, _ in preds[b]]
        while stack:
            a = stack.pop()
            if not reach[a, b]:
                reach[a, b] = True
                stack += [c for c, _ in preds[a]]
    pairs = [(a, b) for a in range(n) for b in range(a + 1, n)
             if nodes[a][1] == nodes[b][1] and not reach[a, b] and not reach[b, a]]
    nv = n + 1 + len(pairs)                       # S..., T, y...
    T = n
    big = float(dur.sum() + m * pp * max(comm + [0.0]) + 1.0)
    rows, lo, hi = [], [], []

    def add(coefs: dict[int, float], low: float, high: float) -> None:
        row = np.zeros(nv)
        for j, c in coefs.items():
            row[j] += c
        rows.append(row)
        lo.append(low)
        hi.append(high)

    for b in range(n):
        for a, lag in preds[b]:
            add({b: 1, a: -1}, dur[a] + lag, np.inf)          # S_b >= S_a + d_a + lag
        add({T: 1, b: -1}, dur[b], np.inf)                    # T >= S_b + d_b
    for p, (a, b) in enumerate(pairs):
        y = n + 1 + p                                         # y = 1: a before b
        add({b: 1, a: -1, y: -big}, dur[a] - big, np.inf)
        add({a: 1, b: -1, y: big}, dur[b], np.inf)

    def before(a: int, b: int):
        """(constant, {y: coef}) of the indicator 'a runs before b'."""
        if reach[a, b]:
            return 1.0, {}
        if reach[b, a]:
            return 0.0, {}
        if a < b:
            return 0.0, {n + 1 + pairs.index((a, b)): 1.0}
        return 1.0, {n + 1 + pairs.index((b, a)): -1.0}

    for j, (op, s, k) in enumerate(nodes):
        if op != "F":
            continue
        const = static[s] + act[s]
        coefs: dict[int, float] = {}
        for i, (op2, s2, k2) in enumerate(nodes):
            if s2 != s or i == j:
                continue
            delta = {"F": act[s], "I": -(act[s] - keep[s]), "W": -keep[s]}[op2]
            c0, ys = before(i, j)
            const += delta * c0
            for y, c in ys.items():
                coefs[y] = coefs.get(y, 0.0) + delta * c
        add(coefs, -np.inf, memory_limit - const)
    c = np.zeros(nv)
    c[T] = 1.0
    integrality = np.zeros(nv)
    integrality[n + 1:] = 1
    lb = np.zeros(nv)
    ub = np.full(nv, np.inf)
    ub[n + 1:] = 1
    res = milp(c, constraints=LinearConstraint(np.array(rows), lo, hi), integrality=integrality,
               bounds=Bounds(lb, ub), options={"time_limit": time_limit})
    if res.status != 0:
        raise RuntimeError(f"milp did not prove an optimum: {res.message}")
    start = res.x[:n]
    orders = [[Action(op, s, k) for (op, s, k), _ in sorted(
        ((nd, start[i]) for i, nd in enumerate(nodes) if nd[1] == r), key=lambda x: (x[1], "FIW".index(x[0][0])))]
        for r in range(pp)]
    return float(res.x[T]), pipesim.Schedule(pp, 1, m, "looped", orders, name="ilp-optimum")
