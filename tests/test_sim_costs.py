"""CostModel: defaults, validation, JSON, the transformer formulas and fitting to a trace."""
import json
import math

import pytest
from hypothesis import given, settings, strategies as st

import pipesim
from pipesim import CostModel, simulate
from pipesim.sim.calibrate import fit_costs
from pipesim.hardware import Hardware, get_hardware
from pipesim.plan.model import ModelSpec, get_model
from pipesim.plan.transformer import split_layers


def test_backward_defaults():
    assert CostModel(forward=2.0).compute_times(1) == {"F": [2.0], "B": [4.0], "I": [2.0], "W": [2.0]}
    assert CostModel(backward_input=1.5, backward_weight=0.5).compute_times(1)["B"] == [2.0]
    c = CostModel(backward=3.0, backward_input=1.0).compute_times(2)
    assert c["W"] == [2.0, 2.0] and c["I"] == [1.0, 1.0]
    c = CostModel(forward=[1.0, 2.0], backward=[4.0, 6.0]).compute_times(2)
    assert c["I"] == [2.0, 3.0] and c["W"] == [2.0, 3.0]


@pytest.mark.parametrize("kwargs,match", [
    ({"forward": -1.0}, "CostModel.forward must be >= 0"),
    ({"forward": "fast"}, "CostModel.forward must be a number"),
    ({"p2p_latency": [1.0, 2.0]}, "CostModel.p2p_latency must be a number"),
    ({"weight_grad_fraction": 1.5}, "weight_grad_fraction must be in"),
    ({"p2p_bandwidth": 0}, "p2p_bandwidth must be > 0"),
    ({"activation_bytes": []}, "activation_bytes is an empty list"),
    ({"backward": float("nan")}, "CostModel.backward is NaN"),
])
def test_validation_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CostModel(**kwargs)


def test_per_stage_length_checked():
    c = CostModel(activation_bytes=[1.0, 2.0, 3.0], static_bytes=[5.0, 6.0])
    with pytest.raises(ValueError, match="CostModel.activation_bytes has 3 per-stage values, expected num_stages = 4"):
        c.stage_values("activation_bytes", 4)
    with pytest.raises(ValueError, match="CostModel.static_bytes has 2 per-rank values, expected pp = 3"):
        c.rank_static_bytes(3)
    s = pipesim.build_schedule("1f1b", pp=4, microbatches=4)
    with pytest.raises(ValueError, match="CostModel.activation_bytes has 3 per-stage values"):
        simulate(s, c)     # checked before simulating, not when memory is first asked for


@settings(max_examples=30, deadline=None)
@given(values=st.lists(st.floats(0, 1e12, allow_nan=False), min_size=1, max_size=6),
       frac=st.floats(0, 1), inf_bw=st.booleans())
def test_json_roundtrip(tmp_path_factory, values, frac, inf_bw):
    c = CostModel(forward=values, activation_bytes=values[0], weight_grad_fraction=frac,
                  p2p_bandwidth=math.inf if inf_bw else 1e9, static_bytes=[1.0, 2.0])
    path = tmp_path_factory.mktemp("c") / "costs.json"
    c.save(path)
    assert json.loads(path.read_text())["p2p_bandwidth"] == ("inf" if inf_bw else 1e9)
    assert CostModel.load(path) == c


def test_json_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"forward": 1.0, "fwd": 2.0}))
    with pytest.raises(ValueError, match=r"bad.json: unknown CostModel field\(s\) fwd"):
        CostModel.load(bad)
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        CostModel.load(bad)


def test_uniform_rejects_lists():
    with pytest.raises(ValueError, match="uniform: forward must be a scalar"):
        CostModel.uniform(forward=[1.0, 2.0])


def test_transformer_matches_cited_formulas():
    spec = ModelSpec("t", layers=6, hidden=64, heads=4, seq_length=32, vocab=100)
    hw = Hardware("toy", peak_flops=1e12, memory_bytes=1e9, link_bandwidth=1e10,
                  network_bandwidth=1e9, hbm_bandwidth=1e11)
    b, s, h, a, v, eff = 2, 32, 64, 4, 100, 0.5
    c = CostModel.transformer(spec, hw, num_stages=3, micro_batch_size=b, efficiency=eff)
    rate = 1e12 * eff
    layer_f = 24 * b * s * h * h * (1 + s / (6 * h))          # Narayanan et al. 2021
    head = 2 * b * s * h * v
    assert c.forward == pytest.approx((2 * layer_f / rate, 2 * layer_f / rate, (2 * layer_f + head) / rate))
    # ZB Table 1: B = 2F per layer, W = the matmul part of F, I the rest.
    layer_w = 24 * b * s * h * h
    assert c.backward_weight[0] == pytest.approx(2 * layer_w / rate)
    assert c.backward_input[0] + c.backward_weight[0] == pytest.approx(2 * 2 * layer_f / rate)
    layer_act = s * b * h * (34 + 5 * a * s / h)                # Korthikanti et al. 2022
    assert c.activation_bytes[1] == pytest.approx(2 * layer_act)
    assert c.activation_bytes[0] == pytest.approx(2 * layer_act + s * b * h)
    assert c.activation_bytes[2] == pytest.approx(2 * layer_act + 2 * s * b * h + 4 * s * b * v)
    assert c.weight_grad_fraction[1] == pytest.approx(14 / (34 + 5 * a * s / h))
    assert c.p2p_bytes == 2 * s * b * h
    assert c.p2p_bandwidth == 1e9 and c.p2p_latency == hw.network_latency
    layer_params = 12 * h * h + 13 * h
    assert c.stage_static_bytes[1] == 16 * 2 * layer_params


def test_transformer_presets():
    params = sum(CostModel.transformer("gpt3-1.3b", "A100", num_stages=4).stage_static_bytes) / 16
    assert 1.3e9 < params < 1.5e9     # 1.2e9 in blocks + two 50257 x 2048 embeddings
    # what CUDA reports on an H200 (139.8 GiB of its 141), case-insensitive lookup
    assert get_hardware("h200").memory_bytes == 150_109_880_320
    assert get_hardware("H100").memory_bytes == 80 * 2**30
    assert get_model("GPT3-175B").layers == 96
    with pytest.raises(ValueError, match="unknown hardware preset 'B900'"):
        get_hardware("B900")
    with pytest.raises(ValueError, match="fewer than num_stages"):
        CostModel.transformer("tiny", num_stages=16)
    assert split_layers(10, 4) == [3, 3, 2, 2]


def test_from_trace_recovers_costs():
    s = pipesim.build_schedule("zb-h1", pp=3, microbatches=6)
    truth = CostModel(forward=[1.0, 1.5, 2.0], backward_input=[0.7, 0.8, 0.9],
                      backward_weight=[0.4, 0.5, 0.6], p2p_latency=0.05, p2p_bandwidth=200.0,
                      p2p_bytes=[10.0, 30.0, 0.0])
    fitted = fit_costs(simulate(s, truth).trace, activation_bytes=3.0)
    for field in ("forward", "backward_input", "backward_weight"):
        assert getattr(fitted, field) == pytest.approx(getattr(truth, field), rel=1e-9)
    assert fitted.backward is None
    assert fitted.p2p_latency == pytest.approx(0.05, rel=1e-6)
    assert fitted.p2p_bandwidth == pytest.approx(200.0, rel=1e-6)
    assert fitted.p2p_bytes[:2] == pytest.approx((10.0, 30.0))
    assert fitted.activation_bytes == 3.0
    # Predicting the run back from the fitted model gives the same step.
    assert simulate(s, fitted).makespan == pytest.approx(simulate(s, truth).makespan, rel=1e-9)


def test_from_trace_full_backward_and_errors():
    s = pipesim.build_schedule("1f1b", pp=2, microbatches=3)
    tr = simulate(s, CostModel(forward=[1.0, 2.0], backward=[3.0, 4.0])).trace
    fitted = fit_costs(tr)
    assert fitted.backward == (3.0, 4.0) and fitted.backward_input is None
    assert fitted.p2p_latency == 0.0
    missing = tr[~((tr["op"] == "B") & (tr["stage"] == 1))]
    with pytest.raises(ValueError, match=r"B is measured on some stages but not on stage\(s\) \[1\]"):
        fit_costs(missing)
