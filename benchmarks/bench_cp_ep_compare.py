"""Context and expert parallelism: predicted vs measured step times, side by side.

For each pair, a run at cp 1 (ep 1) is profiled with ``pipeexec compare`` (predicted from its own
trace), then the run at cp 2 (ep 2) is predicted from it before running (``pipeexec compare
--calibrate-from RUN --hardware FILE``: the measured compute carried by the plan's per-operator
model, `pipeexec.analysis.tensor_parallel.carry_to_layout`; cp's K/V all-gathers and dK/dV
reduce-scatters and ep's dispatch / combine all-to-alls priced from the file's measured gloo
figures, cp as pipeexec runs it: exposed, the attention recomputed in the backward) and
measured:

* cp: the built-in GPT (4 layers, hidden 64, 4 heads, sequence 256, 2 sequences a microbatch),
  1F1B, pp 2, 4 microbatches; cp 1 on 2 ranks, cp 2 on 4;
* ep: a tiny Hugging Face Mixtral (hidden 64, 4 layers, 4 experts top-2, sequence 128), 1F1B,
  pp 2 x dp 2 (4 ranks), 4 microbatches; ep 1, then ep 2 (carved out of dp).

Every rank is confined to ``--cpus-per-rank`` (default 0.25: 4 ranks on one core of a 2-core
machine shared with other work). The machine is noisy: ``--repeats`` (default 2) runs each pair
again, and the table has one row per run. The collective column is the prediction's cp or ep
seconds per step on its busiest rank (the report's ``predicted_collectives``).

    pipeexec calibrate-hardware --out cpu.json
    python benchmarks/bench_cp_ep_compare.py --hardware cpu.json        # about 3 minutes
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

GPT = ["--layers", "4", "--hidden", "64", "--heads", "4", "--seq-len", "256",
       "--micro-batch-size", "2", "--pp", "2", "--microbatches", "4", "--schedule", "1f1b"]
MIXTRAL = dict(model_type="mixtral", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
               max_position_embeddings=512, num_local_experts=4, num_experts_per_tok=2,
               bos_token_id=1, eos_token_id=2)
MOE = ["--seq-len", "128", "--micro-batch-size", "2", "--pp", "2", "--dp", "2",
       "--microbatches", "4", "--schedule", "1f1b"]


def run_compare(argv: list[str], report: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "pipeexec", "compare", *argv, "--report-out", str(report)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return json.loads(report.read_text())


def pair(label: str, flag: str, base: list[str], hardware: str, cpus: float, d: Path,
         k: int) -> list[tuple]:
    """The size-1 run (own trace) and the size-2 run predicted from it."""
    trace = d / f"{label}-{k}.json"
    one = run_compare([*base, "--cpus-per-rank", str(cpus), "--trace-out", str(trace)],
                      d / f"{label}-{k}-1.report.json")
    two = run_compare([*base, flag, "2", "--calibrate-from", str(trace), "--hardware", hardware,
                       # the model and CPU share are the calibration run's
                       ], d / f"{label}-{k}-2.report.json")
    group = flag.lstrip("-")
    rows = []
    for size, rep, how in ((1, one, "own trace"), (2, two, f"from the {group} 1 run")):
        coll = rep.get("predicted_collectives", {}).get(group, [])
        rows.append((f"{group} {size}", how, rep["predicted_step_time"],
                     rep["measured_step_time"], rep["step_time_error"], max(coll, default=0.0)))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hardware", required=True, metavar="FILE",
                   help="the hardware file (`pipeexec calibrate-hardware --out FILE`)")
    p.add_argument("--cpus-per-rank", type=float, default=0.25)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--only", choices=("cp", "ep"), default=None, help="one of the two pairs")
    ns = p.parse_args(argv)
    print("python benchmarks/bench_cp_ep_compare.py " + " ".join(argv or sys.argv[1:]))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        moe_dir = d / "mixtral"
        moe_dir.mkdir()
        (moe_dir / "config.json").write_text(json.dumps(MIXTRAL))
        for k in range(ns.repeats):
            if ns.only in (None, "cp"):
                rows += pair("cp", "--cp", GPT, ns.hardware, ns.cpus_per_rank, d, k)
            if ns.only in (None, "ep"):
                rows += pair("ep", "--ep", ["--hf-model", str(moe_dir), *MOE], ns.hardware,
                             ns.cpus_per_rank, d, k)
    print(f"{'layout':<8} {'predicted':<18} {'pred ms':>8} {'meas ms':>8} {'error':>7} "
          f"{'cp/ep coll. ms/step':>20}")
    for layout, how, pred, meas, err, coll in rows:
        print(f"{layout:<8} {how:<18} {pred * 1e3:>8.1f} {meas * 1e3:>8.1f} {err:>+7.1%} "
              f"{coll * 1e3:>20.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
