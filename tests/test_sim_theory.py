"""The simulator against closed-form results of the papers (uniform costs, zero communication).

Exact to 1e-9: these are sums of a few floats, so any drift means a wrong start time.
"""
import pytest

import pipesim
from pipesim import CostModel, simulate

TOL = 1e-9


def run(name, pp, m, vpp=1, **costs):
    schedule = pipesim.build_schedule(name, pp=pp, microbatches=m, vpp=vpp)
    return simulate(schedule, CostModel.uniform(**costs))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,m", [(2, 1), (2, 5), (4, 3), (4, 8), (5, 16), (8, 8)])
def test_gpipe_1f1b_bubble_fraction(name, pp, m):
    r = run(name, pp, m, forward=1.0, backward=2.0)
    assert r.bubble_fraction == pytest.approx((pp - 1) / m, abs=TOL)
    # The ZB paper's measure for the same run: (p-1)/(m+p-1), on rank 0.
    assert r.bubble_rate == pytest.approx((pp - 1) / (m + pp - 1), abs=TOL)
    assert r.makespan == pytest.approx((m + pp - 1) * 3.0, abs=TOL)


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 4), (4, 2, 8), (4, 3, 8), (4, 2, 12), (3, 4, 6)])
def test_interleaved_bubble_fraction(pp, vpp, m):
    r = run("interleaved", pp, m, vpp=vpp, forward=1.0, backward=2.0)
    assert r.bubble_fraction == pytest.approx((pp - 1) / (vpp * m), abs=TOL)


@pytest.mark.parametrize("pp,m", [(2, 1), (4, 2), (4, 8), (6, 10)])
def test_peak_inflight(pp, m):
    assert run("1f1b", pp, m).peak_inflight == [min(pp - r, m) for r in range(pp)]
    assert run("gpipe", pp, m).peak_inflight == [m] * pp


# Zero Bubble (Qi et al. 2024). Bubble time is idle time inside the worst rank's own span.
@pytest.mark.parametrize("pp,m", [(4, 8), (4, 12), (6, 12), (8, 16)])
@pytest.mark.parametrize("f,i,w", [(1.0, 1.0, 1.0), (1.0, 1.5, 0.5), (2.0, 1.0, 1.0)])
def test_zb_h1_bubble(pp, m, f, i, w):
    r = run("zb-h1", pp, m, forward=f, backward_input=i, backward_weight=w)
    assert r.bubble_time == pytest.approx((pp - 1) * (f + i - w), abs=TOL)
    # Memory no worse than 1F1B: at most p - r microbatches in flight on rank r.
    assert all(r.peak_inflight[k] <= pp - k for k in range(pp))


# ZB-H2's bubble (p-1)(F+I-2W) holds when the extra warm-up forwards and the W tail can fill
# the gaps: F + I >= 2W, and m >= 2p - 1 so the parallelogram's middle exists.
@pytest.mark.parametrize("pp,m", [(4, 8), (4, 12), (6, 12)])
@pytest.mark.parametrize("f,i,w", [(1.0, 1.0, 1.0), (1.5, 1.5, 1.0), (2.0, 1.0, 1.0)])
def test_zb_h2_bubble(pp, m, f, i, w):
    r = run("zb-h2", pp, m, forward=f, backward_input=i, backward_weight=w)
    assert r.bubble_time == pytest.approx((pp - 1) * (f + i - 2 * w), abs=TOL)


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16), (6, 12)])
def test_zbv_zero_bubble(pp, m):
    r = run("zbv", pp, m, vpp=2, forward=1.0, backward_input=1.0, backward_weight=1.0)
    assert r.bubble_time == pytest.approx(0.0, abs=TOL)
    assert r.bubble_rate == pytest.approx(0.0, abs=TOL)
