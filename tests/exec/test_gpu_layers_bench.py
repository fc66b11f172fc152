"""benchmarks/bench_gpu_layers.py on the CPU (its --quick units): it times F, B, I and W of
units pipeexec builds, and the bytes each forward saves for the backward equal the plan's
activation formula (the same check the stored H200 run passes: tests/test_gpu_figures.py)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    if "bench_gpu_layers" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_gpu_layers",
                                                      ROOT / "benchmarks/bench_gpu_layers.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["bench_gpu_layers"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["bench_gpu_layers"]


def test_quick_units_time_every_pass_and_save_what_the_plan_counts(tmp_path):
    out = tmp_path / "layers.json"
    assert _bench().main(["--device", "cpu", "--quick", "--repeats", "1", "--hardware", "H200",
                          "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["unit"] for r in rows} == {"gpt h256 block", "llama h256 layer", "llama h256 head"}
    for r in rows:
        assert all(r["measured"][op] > 0 for op in ("F", "B", "I", "W")), r["unit"]
        assert r["predicted_activation_bytes"] == pytest.approx(r["measured"]["saved_bytes"],
                                                                rel=0.01), r["unit"]


def test_stored_measurements_are_predicted_again_without_a_device(capsys):
    assert _bench().main(["--from", str(ROOT / "tests/data/h200_layers.json"),
                          "--hardware", "H200"]) == 0
    out = capsys.readouterr().out
    assert "measured on NVIDIA H200 (2026-12-04), predicted now" in out
    assert out.count("| llama3-8b layer |") == 8
