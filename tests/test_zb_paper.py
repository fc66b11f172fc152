"""zb-auto against the Zero Bubble paper's own figures: its profiled costs, its memory count and
its ZB-2p limit (2 p M_B), row by row of its Table 5; and, on small cases with the paper's kind
of costs (W cheaper than F) at the 2p limit, against the exact optimum (tests/zb_ilp.py).

Source: Qi, Wan, Huang, Lin, "Zero Bubble Pipeline Parallelism", ICLR 2024, Table 5 (profiled
T_F, T_B, T_W, T_comm in ms per stage; bubble rates, the largest idle share of a stage's own
span, pipesim's ``bubble_rate``) and Table 3 (each model's hidden size h, heads a, sequence s).
Memory as the paper's code counts it: an F holds 34h + 5as (per layer per token), of which 32h
stay from its B (pipesim's I) to its W. The rows' costs and the 1F1B column were checked by
simulating 1F1B (it reproduces the column's 0.2431, 0.1985, 0.2347, 0.2552, 0.2082); the
ZB-2p values of the 1.5B rows are as quoted second-hand (the quotation also bounds the other
m = 3p rows at 0.003-0.007); the other rows' ZB-2p values could not be checked against
the PDF on the machine that wrote this test: re-check them against the paper when it is at hand.
"""
import pytest

import pipesim
from pipesim import CostModel, simulate

# model: (h, a, s)  (Table 3)
MODELS = {"1.5B": (2304, 24, 1024), "6.2B": (4096, 32, 1024), "14.6B": (5120, 40, 1024),
          "28.3B": (6144, 48, 1024)}

# model, p, m, T_F, T_B, T_W, T_comm, the paper's ZB-2p bubble rate  (Table 5)
TABLE_5 = [
    ("1.5B", 8, 24, 18.522, 18.086, 9.337, 0.601, 0.0433),
    ("1.5B", 8, 32, 18.513, 18.132, 9.430, 0.626, 0.0039),
    ("1.5B", 8, 64, 18.546, 18.302, 9.370, 0.686, 0.0026),
    ("6.2B", 8, 24, 29.718, 29.444, 19.927, 0.527, 0.0072),
    ("6.2B", 8, 32, 29.802, 29.572, 19.938, 0.529, 0.0033),
    ("6.2B", 8, 64, 29.935, 29.461, 19.878, 0.536, 0.0036),
    ("14.6B", 16, 48, 11.347, 11.248, 8.132, 0.377, 0.0044),
    ("14.6B", 16, 64, 11.307, 11.254, 8.101, 0.379, 0.0045),
    ("14.6B", 16, 128, 11.325, 11.308, 8.109, 0.382, 0.0029),
    ("28.3B", 32, 96, 10.419, 10.207, 7.715, 0.408, 0.0052),
    ("28.3B", 32, 128, 10.408, 10.204, 7.703, 0.408, 0.0050),
    ("28.3B", 32, 256, 10.402, 10.248, 7.698, 0.460, 0.0033),
]
# Within this of the paper's figure: its costs are rounded to the microsecond, and its own
# search is the same kind of heuristic (ZB-H2's order, which zb-auto returned before, is 0.03-0.07
# off on every row: ``test_zb_h2_alone_misses_the_column`` keeps this test able to fail).
SLACK = 0.0025


def paper_costs(model: str, tf: float, tb: float, tw: float, tc: float) -> CostModel:
    h, a, s = MODELS[model]
    held = 34 * h + 5 * a * s
    return CostModel(forward=tf, backward_input=tb, backward_weight=tw, p2p_latency=tc,
                     activation_bytes=1.0, weight_grad_fraction=32 * h / held)


def rows(small_first=True):
    return sorted(TABLE_5, key=lambda r: r[1] * r[2]) if small_first else TABLE_5


@pytest.mark.parametrize("model,p,m,tf,tb,tw,tc,paper", rows(),
                         ids=[f"{r[0]}-p{r[1]}-m{r[2]}" for r in rows()])
def test_zb_2p_limit_reaches_the_papers_column(model, p, m, tf, tb, tw, tc, paper):
    """Under 2 p M_B zb-auto's order has the paper's ZB-2p bubble rate (within SLACK), fits
    the limit, and no hand-made order that fits is simulated faster."""
    costs = paper_costs(model, tf, tb, tw, tc)
    s = pipesim.build_schedule("zb-auto", pp=p, microbatches=m, costs=costs, memory_limit=2 * p)
    r = simulate(s.validate(), costs)
    print(f"{model} p{p} m{m}: zb-auto ZB-2p {r.bubble_rate:.4f}, paper {paper:.4f}")
    assert r.bubble_rate <= paper + SLACK
    assert max(r.peak_memory) <= 2 * p * (1 + 1e-12)
    for name in ("1f1b", "zb-h1", "zb-h2"):
        hand = simulate(pipesim.build_schedule(name, pp=p, microbatches=m), costs)
        if max(hand.peak_memory) <= 2 * p:
            assert r.makespan <= hand.makespan * (1 + 1e-12), name


@pytest.mark.parametrize("model,p,m,tf,tb,tw,tc,paper", [r for r in TABLE_5 if r[2] == 3 * r[1]],
                         ids=lambda v: str(v) if isinstance(v, str) else None)
def test_zb_h2_alone_misses_the_column(model, p, m, tf, tb, tw, tc, paper):
    """The hand-made ZB-H2 (the paper's ZB-2p analogue for T_F = T_B = T_W) leaves several times
    the paper's bubble on these costs: the column above is not reached by hand-made orders."""
    costs = paper_costs(model, tf, tb, tw, tc)
    r = simulate(pipesim.build_schedule("zb-h2", pp=p, microbatches=m), costs)
    assert r.bubble_rate > paper + 5 * SLACK


@pytest.mark.parametrize("pp,m,seed", [(2, 4, 0), (3, 3, 1), (3, 4, 2), (4, 4, 3)])
def test_2p_limit_against_the_exact_optimum(pp, m, seed):
    """Small cases with W cheaper than F and I (the paper's profiles), zero communication, the
    2p limit: zb-auto's makespan is never below the MILP's optimum (the two models agree) and
    within 3% of it."""
    import random

    pytest.importorskip("scipy.optimize")
    from zb_ilp import optimal_schedule

    rng = random.Random(seed)
    costs = CostModel(forward=[rng.uniform(0.9, 1.1) for _ in range(pp)],
                      backward_input=[rng.uniform(0.9, 1.1) for _ in range(pp)],
                      backward_weight=[rng.uniform(0.4, 0.7) for _ in range(pp)],
                      activation_bytes=1.0, weight_grad_fraction=0.4)
    limit = 2 * pp
    optimum, _ = optimal_schedule(pp, m, costs, limit)
    found = simulate(pipesim.build_schedule("zb-auto", pp=pp, microbatches=m, costs=costs,
                                            memory_limit=limit), costs)
    gap = found.makespan / optimum - 1
    print(f"pp={pp} m={m}: zb-auto {found.makespan:.4f} vs optimum {optimum:.4f} ({100 * gap:.2f}%)")
    assert max(found.peak_memory) <= limit + 1e-9
    assert gap >= -1e-6
    assert gap <= 0.03
