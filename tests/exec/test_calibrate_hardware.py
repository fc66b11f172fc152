"""``pipeexec calibrate-hardware``: the curve fit recovers a known curve; the file it writes on
this machine predicts a CPU pipeline run (never measured before) within the README's bound; the
collective benchmark covers the runs' message sizes, measures positive figures, ends a stuck
rank in its timeout, and its figures reach the file (the fits themselves:
tests/test_collective_figures.py)."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

import pipesim
from pipesim.hardware import get_hardware

from pipeexec.measuring.calibrate_hardware import fit_gemm_curve

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


def _cpu_seconds_of_others(command: list[str], env: dict) -> tuple[subprocess.CompletedProcess,
                                                                  float]:
    """Run ``command`` and say how many cores, on average over its run, went to anything else:
    the machine's busy time (``/proc/stat``; steal time, a virtual machine's neighbours, counts as
    busy) less the CPU time of the command and its children (``RUSAGE_CHILDREN``)."""
    def busy_and_children() -> tuple[float, float]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        idle = fields[3] + fields[4]                                  # idle + iowait
        ticks = os.sysconf("SC_CLK_TCK")
        used = resource.getrusage(resource.RUSAGE_CHILDREN)
        return (sum(fields[:8]) - idle) / ticks, used.ru_utime + used.ru_stime

    busy0, mine0 = busy_and_children()
    t0 = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    wall = time.perf_counter() - t0
    busy1, mine1 = busy_and_children()
    return done, max(0.0, (busy1 - busy0) - (mine1 - mine0)) / wall


#: Cores other work may take while the calibration or the run is measured, for the comparison
#: to count: more, and the run did not have the machine the calibration measured.
QUIET_CORES = 0.3


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads the machine's load in /proc")
def test_a_cpu_run_predicted_from_the_measured_hardware_file_lands_near_it(tmp_path):
    """Calibrate this machine (GEMM sweep, element-wise bandwidth, launch overhead, attention,
    gloo all-reduce), then predict a 2-stage 1F1B run from that file alone (no trace of the
    run) and run it: the best step after the first lands within 30% of the prediction. The
    collectives are measured over the run's one group size, 2 ranks (``--collective-groups
    2``): a 2-rank pipeline's prediction reads the 2-rank figures alone (the link's are the
    2-rank all-reduce's), the same with or without the 4-rank ones, which took about 40% of
    the calibration's CPU time (4 gloo ranks on 2 cores).

    Measured on the 2-core development machine (2026-12-02, quiet), predicted / measured was
    0.90, 0.91 and 0.84 over three calibrate-and-run pairs: the prediction is 10-15% fast, and
    the run itself moves by up to 20% from one job to the next (F of stage 0 took 22.6 ms in one
    job, 28.7 ms in the next, CPU time equal to wall time in both). The bound is for a
    calibration that is wrong (a unit, a rate off by a factor), not for that noise.

    The comparison holds only where the run had the cores the calibration measured: CI once
    measured the run 1.52x slow (0.986 s) on a calibration that was right (0.662 s), the 2
    ranks sharing the 2 cores with one more busy process. So each attempt measures how many
    cores other work took during its calibration and its run (steal time included); up to three
    attempts are made, a busy one does not count, any quiet one within the bound passes, quiet
    ones all off fail (naming each), and three busy ones skip, naming the load."""
    from pipeexec.cli.train import config_from_args, train_parser

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    flags = ["--schedule", "1f1b", "--pp", "2", "--microbatches", "8", "--micro-batch-size", "4",
             "--layers", "4", "--hidden", "256", "--heads", "4", "--seq-len", "128"]
    busy, off = [], []
    for attempt in range(3):
        hw_file, out = tmp_path / f"cpu{attempt}.json", tmp_path / f"m{attempt}.json"
        done, others_cal = _cpu_seconds_of_others(
            [sys.executable, "-m", "pipeexec", "calibrate-hardware", "--collective-groups", "2",
             "--out", str(hw_file)], env)
        assert done.returncode == 0, done.stderr[-3000:]
        hw = get_hardware(str(hw_file))
        assert hw.calibration == "measured" and hw.gemm_table and hw.source("launch_overhead")
        plan = config_from_args(train_parser().parse_args(flags)).plan_as_run()
        predicted = pipesim.simulate(plan.with_(cluster=plan.cluster.with_(hardware=hw))).step_time
        done, others_run = _cpu_seconds_of_others(
            [sys.executable, "-m", "pipeexec", "train", *flags, "--steps", "6", "--no-progress",
             "--metrics-out", str(out)], env)
        assert done.returncode == 0, done.stderr[-3000:]
        measured = min(json.loads(out.read_text())["step_times"][1:])
        what = (f"attempt {attempt + 1}: predicted {predicted:.3f} s, measured {measured:.3f} s, "
                f"other work {others_cal:.2f} cores during the calibration, {others_run:.2f} "
                "during the run")
        if max(others_cal, others_run) > QUIET_CORES:
            busy.append(what)
        elif abs(predicted / measured - 1) <= 0.30:
            return
        else:
            off.append(what)
    assert not off, "a quiet machine's run is more than 30% off its prediction: " + "; ".join(
        off + busy)
    pytest.skip("the machine was busy in every attempt: " + "; ".join(busy))


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
def test_calibrate_hardware_writes_measured_collectives_that_hardware_file_reads(tmp_path, capfd):
    """The command end to end (quick sweep), its file read by ``pipesim plan --hardware FILE``,
    and the benchmark script's side-by-side table. (The measuring command and the script run
    in their own processes, as a user runs them; the file's reader and a refused flag in this
    one, `cli_helpers.run_pipeexec`.)"""
    from pipesim.cli import main as pipesim_main

    from cli_helpers import run_pipeexec

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
    assert pipesim_main(["simulate", "1f1b", "--model", "llama3-8b", "--hardware", str(hw_file),
                         "--tp", "2", "--pp", "2", "--global-batch-size", "4", "--report-out",
                         str(report)]) == 0
    tp = json.loads(report.read_text())["links"]["tp"]
    assert {c["collective"] for c in tp["collectives"]} == set(data["collectives"]["intra"])
    done = run_pipeexec(["calibrate-hardware", "--out", str(hw_file), "--collective-sizes",
                         "4"], capfd)
    assert done.returncode == 2 and "--collective-sizes '4'" in done.stdout
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_collectives.py"),
                           "--groups", "2", "--sizes", "4KiB,32MiB", "--repeats", "5"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "fit/meas" in done.stdout and "summary: 8 points, fit error median" in done.stdout


def test_a_cuda_device_is_stated_against_the_preset_its_name_names(monkeypatch):
    """On a GPU the measured efficiencies are fractions of a datasheet's peak: the preset named
    by the device (GB200 before B200), or --base; a name that names none is refused, saying
    what to pass."""
    import torch

    from pipeexec.measuring.calibrate_hardware import base_preset

    for device_name, preset in (("NVIDIA H200", "H200"), ("NVIDIA H100 80GB HBM3", "H100"),
                                ("NVIDIA A100-SXM4-80GB", "A100"), ("NVIDIA GB200", "GB200"),
                                ("NVIDIA B200", "B200")):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None, n=device_name: n)
        assert base_preset("cuda", None).name == preset, device_name
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Tesla V100-SXM2-32GB")
    with pytest.raises(ValueError, match="names no preset.*--base"):
        base_preset("cuda", None)
    assert base_preset("cuda", "H100").name == "H100"


def test_base_is_refused_on_a_cpu(tmp_path, capfd):
    from cli_helpers import run_pipeexec

    done = run_pipeexec(["calibrate-hardware", "--out", str(tmp_path / "x.json"), "--base",
                         "H200"], capfd)
    assert done.returncode == 2 and "--base H200: only for a CUDA device" in done.stdout
    assert not (tmp_path / "x.json").exists()


def test_a_cpu_is_measured_with_one_thread_as_a_rank_runs_and_the_file_says_so(monkeypatch):
    """torch's default pool of every core measured another machine than pipeexec's ranks (each
    one thread): the sweep runs with --threads (default 1) and the file records it and the load."""
    import torch

    from pipeexec.measuring import calibrate_hardware as ch

    seen = []
    monkeypatch.setattr(ch, "gemm_sweep", lambda device, dtype, repeat=7, sizes=ch.SIZES: (
        seen.append(torch.get_num_threads()) or [(64, 64, 64, 1e9), (128, 128, 128, 2e9)]))
    monkeypatch.setattr(ch, "elementwise_bandwidth", lambda device, nbytes, repeat=7: 5e10)
    monkeypatch.setattr(ch, "launch_overhead", lambda device, repeat=200: 1e-6)
    monkeypatch.setattr(ch, "attention_efficiency", lambda device, dtype, peak: 0.3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        hw = ch.calibrate("cpu", links=False)
        assert seen == [1]
        assert hw.source("threads").startswith("1 torch thread(s)") and "load average" in hw.source("threads")
        ch.calibrate("cpu", links=False, threads=2)
        assert seen == [1, 2]
    finally:
        torch.set_num_threads(before)


def test_a_busy_machine_is_named_before_the_sweep():
    from pipeexec.measuring.calibrate_hardware import busy_note

    assert busy_note(0.4, 2) == ""
    note = busy_note(2.3, 2)
    assert "load average is 2.3 on 2 CPUs" in note and "idle machine" in note
