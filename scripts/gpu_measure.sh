#!/usr/bin/env bash
# Measure one CUDA GPU's figures for pipesim and check the per-operator time model on it
# (about 3 minutes on one H200):
#   bash scripts/gpu_measure.sh [OUT_DIR]        (from the repository root; default out/gpu)
# 1. pipeexec calibrate-hardware --device cuda: the GEMM sweep, HBM bandwidth, attention and
#    per-kernel cost, against the preset the device's name names -> OUT_DIR/gpu_hardware.json
# 2. benchmarks/bench_gpu_layers.py: transformer layers' and a head's F, B, I, W measured with
#    CUDA events against pipesim's prediction from the preset and from that file
#    -> OUT_DIR/gpu_layers.json (and the table on stdout)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-out/gpu}
mkdir -p "$out"
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! python -c "import torch" 2>/dev/null; then
  echo "gpu_measure: $(command -v python) has no torch: install the project first (README)" >&2
  exit 2
fi
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_measure: no CUDA device (torch.cuda.is_available() is False); nothing measured" >&2
  exit 2
fi
status=0
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>/dev/null
preset=$(python -c "from pipeexec.measuring.calibrate_hardware import base_preset; print(base_preset('cuda', None).name)") \
  || { echo "gpu_measure: the device names no preset: run calibrate-hardware with --base" >&2; exit 2; }
echo "== calibrate-hardware on $preset's datasheet"
timeout 240 python -m pipeexec calibrate-hardware --device cuda --out "$out/gpu_hardware.json" \
  || status=1
hw=(--hardware "$preset")
[ -f "$out/gpu_hardware.json" ] && hw+=(--hardware "$out/gpu_hardware.json")
echo "== layers: measured against predicted"
timeout 300 python benchmarks/bench_gpu_layers.py --device cuda "${hw[@]}" \
  --out "$out/gpu_layers.json" || status=1
exit $status
