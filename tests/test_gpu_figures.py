"""What an H200 measured (``bash scripts/gpu_measure.sh`` on one H200, 2026-12-04; the files in
tests/data: ``pipeexec calibrate-hardware --device cuda``'s hardware file and
``benchmarks/bench_gpu_layers.py``'s rows) against what pipesim predicts from them today: the
figures the README and docs/gpus.md quote are recomputed here from the stored measurements, so a
change of the time or memory model that moves them fails here."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from pipesim.hardware import get_hardware

ROOT = Path(__file__).resolve().parents[1]
LAYERS = json.loads((ROOT / "tests/data/h200_layers.json").read_text())
H200_FILE = ROOT / "tests/data/h200_hardware.json"


def _bench():
    import importlib.util
    import sys

    if "bench_gpu_layers" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_gpu_layers",
                                                      ROOT / "benchmarks/bench_gpu_layers.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["bench_gpu_layers"] = mod          # its dataclasses look themselves up
        spec.loader.exec_module(mod)
    return sys.modules["bench_gpu_layers"]


def _ratios(hardware) -> dict[tuple[str, int, str], float]:
    """predicted / measured per (unit, micro-batch, pass), the prediction made now."""
    bench = _bench()
    hw = get_hardware(hardware)
    units = {(u.label, u.micro_batch): u for u in bench.units(quick=False)}
    out = {}
    for row in LAYERS["rows"]:
        unit = units[(row["unit"], row["micro_batch"])]
        pred = bench.predicted(unit, hw)
        for op in bench.OPS:
            out[(row["unit"], row["micro_batch"], op)] = pred[op] / row["measured"][op]
    return out


def test_the_stored_measurements_are_an_h200s():
    assert LAYERS["meta"]["gpu"] == "NVIDIA H200" and LAYERS["meta"]["device"] == "cuda"
    hw = get_hardware(str(H200_FILE))
    assert hw.calibration == "measured" and not hw.extrapolated
    assert hw.peak_flops == get_hardware("H200").peak_flops        # the datasheet's, kept
    assert 0.7 < hw.gemm_e_max <= 1 and 0.7 < hw.mem_efficiency <= 1


def test_activation_memory_of_every_unit_is_the_plans_on_the_h200():
    """The bytes each unit's forward saved on the GPU equal the plan's formula (README: exact
    to 0.1%): the built-in GPT's blocks, Llama layers, the Llama-3-8B head."""
    bench = _bench()
    units = {(u.label, u.micro_batch): u for u in bench.units(quick=False)}
    for row in LAYERS["rows"]:
        plan = bench.predicted_activations(units[(row["unit"], row["micro_batch"])])
        assert plan == pytest.approx(row["measured"]["saved_bytes"], rel=1e-3), row["unit"]


@pytest.mark.parametrize("hardware,every,forward", [("H200", 0.15, 0.05),
                                                     (str(H200_FILE), 0.20, 0.15)])
def test_wide_gpt_blocks_are_predicted_within_the_readmes_bound(hardware, every, forward):
    """README: the built-in GPT's hidden-4096 block (micro-batch 1 and 2) predicted low by at
    most 15% on every pass and 5% on F from the H200 preset (never fitted to an H200), 20% and
    15% from the file measured on it (microbenchmarks: the GEMMs alone reach more than a layer)."""
    r = {k: v for k, v in _ratios(hardware).items() if k[0] == "gpt h4096 block"}
    assert len(r) == 8
    assert all(1 - every <= v <= 1.0 for v in r.values()), r
    assert all(1 - forward <= v for k, v in r.items() if k[2] == "F"), r


def test_small_units_are_predicted_too_fast_as_the_readme_says():
    """README: units of hidden 1024-2048 run bound by the host's dispatch in eager PyTorch, which
    the model (device time only) does not price: predicted at 0.1-0.9 of measured, W worst."""
    r = _ratios("H200")
    small = {k: v for k, v in r.items() if k[0] in ("gpt h1024 block", "llama3.2-1b layer")}
    assert all(v < 0.9 for v in small.values()), small
    assert min(small.values()) == small[("gpt h1024 block", 1, "W")]
    assert statistics.median(r.values()) == pytest.approx(0.85, abs=0.02)
