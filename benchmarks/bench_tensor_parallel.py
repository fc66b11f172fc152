"""Tensor parallelism and ZeRO: what each rank holds, measured against the plan, side by side.

Memory (``--memory``, default on): for tp 1 and tp 2 (with sequence parallelism) at pp 2 x dp 2,
and ZeRO 0, 1, 2, 3 (2 and 3 reducing the gradients once a step and once a microbatch,
``grad_reduce``), one short run per config in one job per tp (CPU, gloo) measures each
pipeline rank's peak of held tensors: activations and training state (weights, fp32 gradients,
masters, AdamW moments), `pipeexec.measuring.memory.TrainingMemoryMeter`; the plan predicts it
from the model's shape alone (`pipeexec.analysis.plan_memory.predicted_peaks`: Korthikanti et
al.'s activation bytes at tp and sp, Megatron's bytes per parameter at the ZeRO level). Memory
does not depend on timing, so the machine's load does not matter.

Prediction (``--compare``): a tp 1 x pp 2 run profiled, then a tp 2 x pp 2 run predicted from it
(`pipeexec compare --calibrate-from ... --hardware FILE`: compute carried by the plan's
per-operator model, tp's collectives from the file's measured gloo figures) and from its own
trace; 4 ranks on 2 cores, each confined to half a core.

    python benchmarks/bench_tensor_parallel.py                 # memory: about 1 minute
    python benchmarks/bench_tensor_parallel.py --compare --hardware cpu.json   # + prediction
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeexec.analysis.plan_memory import predicted_peaks  # noqa: E402
from pipeexec.config import TrainConfig  # noqa: E402

KIB = 1024
# (zero, grad_reduce): ZeRO-2/3 under both reductions (the plan's field, pipesim's default first)
ZEROS = ((0, "per_step"), (1, "per_step"), (2, "per_step"), (2, "per_microbatch"),
         (3, "per_step"), (3, "per_microbatch"))


def config(tp: int, zero: int, schedule: str = "1f1b", vpp: int = 1,
           grad_reduce: str = "per_step") -> TrainConfig:
    return TrainConfig.from_flat(layers=8, hidden=64, heads=4, seq_len=32, vocab=128, pp=2, dp=2,
                                 tp=tp, sequence_parallel=tp > 1, microbatches=4,
                                 micro_batch_size=1, schedule=schedule, vpp=vpp, zero=zero,
                                 grad_reduce=grad_reduce, steps=2, device="cpu",
                                 p2p_timeout=120.0, collective_timeout=300.0)


def memory_worker(board, tp: int) -> dict:
    from pipeexec.measuring.memory import TrainingMemoryMeter
    from pipeexec.topology import destroy_topology, init_topology
    from pipeexec.training.train import train
    from pipeexec.run.assemble import assemble

    topo = init_topology(2, 2, tp=tp, device="cpu", timeout=300)
    out = {"pp_rank": topo.pp_rank, "tp_rank": topo.tp_rank, "dp_rank": topo.dp_rank}
    try:
        for zero, reduce in ZEROS:
            t = assemble(config(tp, zero, grad_reduce=reduce), topo, board=board)
            params = [p for st in t.stages.values() for p in st.parameters()]
            meter = TrainingMemoryMeter(t.runtime, t.state_tensors, exclude=params)
            t.add_stage_hooks(meter)
            t.add_observer(meter)
            train(t)
            out[(zero, reduce)] = (meter.peak, meter.peak_state, meter.peak_activations)
    finally:
        destroy_topology(topo)
    return out


def memory_table() -> None:
    from pipeexec import launch

    print("peak held bytes per pipeline rank (tp rank 0, dp rank 0), KiB: measured / predicted "
          "from the plan alone (error)")
    print(f"{'layout':<22}{'zero':>20}  {'rank 0':>30}  {'rank 1':>30}")
    worst = 0.0
    for tp in (1, 2):
        results = launch(memory_worker, 4 * tp, (tp,), timeout=900)
        for zero, reduce in ZEROS:
            pred = predicted_peaks(config(tp, zero, grad_reduce=reduce))
            cells = []
            for rank in (0, 1):
                r = next(x for x in results if x["pp_rank"] == rank and x["tp_rank"] == 0
                         and x["dp_rank"] == 0)
                meas = r[(zero, reduce)][0]
                err = pred[rank] / meas - 1
                worst = max(worst, abs(err))
                cells.append(f"{meas / KIB:9.1f} / {pred[rank] / KIB:9.1f} ({err:+.1%})")
            layout = f"tp {tp}{' + sp' if tp > 1 else ''} pp 2 dp 2"
            name = f"{zero}" + (f" {reduce}" if zero >= 2 else "")
            print(f"{layout:<22}{name:>20}  {cells[0]:>30}  {cells[1]:>30}")
    print(f"worst error {worst:.1%}")


def compare(hardware: str, cpus: float) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory() as d:
        trace = str(Path(d) / "tp1.json")
        base = [sys.executable, "-m", "pipeexec", "compare", "--pp", "2", "--schedule", "1f1b",
                "--cpus-per-rank", str(cpus)]
        runs = [("tp 1, own trace", base + ["--tp", "1", "--trace-out", trace]),
                ("tp 2, own trace", base + ["--tp", "2"]),
                ("tp 2 from the tp 1 run", base[:-2] + ["--tp", "2", "--calibrate-from", trace,
                                                        "--hardware", hardware])]
        for label, argv in runs:
            done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
            if done.returncode:
                raise SystemExit(f"{' '.join(argv)} failed:\n{done.stderr[-2000:]}")
            head = next(line for line in done.stdout.splitlines() if "predicted" in line
                        and "vs measured" in line)
            print(f"{label:<24} {head.split(';')[0]}")
            for line in done.stdout.splitlines():
                if line.startswith("note: carried"):
                    print(f"{'':<24} {line}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--no-memory", action="store_true", help="skip the memory table")
    p.add_argument("--compare", action="store_true", help="also the tp 2 prediction runs")
    p.add_argument("--hardware", default=None, metavar="FILE",
                   help="with --compare: the hardware file (`pipeexec calibrate-hardware`)")
    p.add_argument("--cpus-per-rank", type=float, default=0.5)
    ns = p.parse_args(argv)
    if ns.compare and ns.hardware is None:
        p.error("--compare needs --hardware FILE (pipeexec calibrate-hardware --out FILE)")
    print("python benchmarks/bench_tensor_parallel.py " + " ".join(argv or sys.argv[1:]))
    if not ns.no_memory:
        memory_table()
    if ns.compare:
        compare(ns.hardware, ns.cpus_per_rank)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
