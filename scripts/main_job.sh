#!/usr/bin/env bash
# The main job: simulate a config, run it for real on 4 CPU ranks (gloo), and compare.
#   bash scripts/main_job.sh [OUT_DIR]        (default: out/)
# 1. pipesim predicts 1F1B on uniform stages (the textbook picture);
# 2. pipeexec trains the built-in GPT with 1F1B on 4 ranks, profiled; pipesim re-simulates it
#    with costs calibrated from that run: predicted vs measured, table and Gantt;
# 3. ZB-V and 1F1B train in one job, alternating steps (the method of
#    benchmarks/bench_prediction.py): ZB-V is predicted from the 1F1B steps alone and compared
#    with its own measured steps, both seconds apart on the same machine.
# The model has 8 blocks: 1F1B cuts them 2 a stage (the embedding on the first, the head on the
# last), ZB-V 1 a stage, so that every rank of either holds two blocks. (With 6 blocks, ZB-V's
# first and last stages, both on rank 0, held only the embedding and the head: rank 0 sat idle
# most of the step and ZB-V could show little over 1F1B.)
# On a machine with fewer than 4 CPUs, each rank is confined to its share of them
# (--cpus-per-rank, a cgroup quota) where the machine allows it, so that every rank computes at
# its own steady speed as with a device per rank; CONFINE=off shares the cores freely instead.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-out}
mkdir -p "$out"
export OMP_NUM_THREADS=1
model=(--pp 4 --microbatches 8 --layers 8 --hidden 256 --heads 4 --seq-len 128
       --micro-batch-size 4 --steps 6 --no-progress)
if [ "${CONFINE:-auto}" != off ]; then
    confine=$(python3 -c "from pipeexec.launching.cpu_quota import cpu_limit, quotas_available
c = cpu_limit()
print(f'--cpus-per-rank {c / 4:g}' if c < 4 and quotas_available() else '')")
    if [ -n "$confine" ]; then
        echo "(fewer than 4 CPUs: each rank confined with $confine)"
        model+=($confine)
    fi
fi

echo "== 1. simulate: 1f1b, pp=4, m=8, uniform stages"
python3 -m pipesim simulate 1f1b --pp 4 --microbatches 8 --gantt "$out/simulated_1f1b.png"

echo "== 2. run 1f1b for real on 4 CPU ranks and compare with its simulation"
python3 -m pipeexec compare --schedule 1f1b "${model[@]}" --trace-out "$out/run_1f1b.json" \
    --report-out "$out/compare_1f1b.json" --table-out "$out/compare_1f1b.md" --plot-out "$out/compare_1f1b.png"

echo "== 3. zbv and 1f1b in one job, alternating steps; zbv predicted from the 1f1b steps alone"
python3 -m pipeexec compare --schedule zbv --vpp 2 "${model[@]}" --alongside 1f1b \
    --trace-out "$out/run_zbv.json" --report-out "$out/compare_zbv.json" --table-out "$out/compare_zbv.md" --plot-out "$out/compare_zbv.png"

python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
print("\n| schedule | measured step | predicted step | error | measured bubble_fraction | predicted |")
print("|---|---:|---:|---:|---:|---:|")
for name, how in (("1f1b", "own trace"), ("zbv", "from 1f1b steps in the same job")):
    r = json.load(open(f"{out}/compare_{name}.json"))
    print(f"| {name} ({how}) | {r['measured_step_time']*1e3:.1f} ms | {r['predicted_step_time']*1e3:.1f} ms "
          f"| {r['step_time_error']:+.1%} | {r['measured_bubble_fraction']:.3f} | {r['predicted_bubble_fraction']:.3f} |")
print(f"\npictures and reports in {out}/ (compare_*.png: predicted above measured)")
PY
