#!/usr/bin/env bash
# GPU check for pipeexec, for when a CUDA machine is lent: the cuda-marked tests, then a short
# benchmark, then the CPU prediction benchmark at pp=4 with a core per rank (the development
# machine has 2 cores, where 4 ranks time-share). Finishes in well under 10 minutes.
#   bash scripts/gpu_check.sh            (from the repository root)
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
status=0
echo "== devices"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "nvidia-smi unavailable"
python - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      "devices", torch.cuda.device_count(),
      "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None)
PY
echo "== cuda-marked tests"
timeout 420 python -m pytest -q -m cuda tests/exec -rs || status=1
NGPU=$(python -c "import torch; print(torch.cuda.device_count())")
BENCH="--layers 8 --hidden 1024 --heads 16 --seq-len 512 --vocab 8192 --micro-batch-size 4 --steps 12 --warmup-steps 2 --no-progress --device cuda"
echo "== benchmark: single GPU reference (pp=1), bf16"
timeout 120 python -m pipeexec train --schedule 1f1b --pp 1 --microbatches 8 --precision bf16 $BENCH \
    --metrics-out /tmp/pipeexec_gpu_pp1.json || status=1
if [ "${NGPU:-0}" -ge 2 ]; then
  for s in 1f1b zbv; do
    vpp=1; [ "$s" = zbv ] && vpp=2
    echo "== benchmark: $s pp=2 vpp=$vpp over NCCL, bf16"
    timeout 120 python -m pipeexec train --schedule $s --pp 2 --vpp $vpp --microbatches 8 \
        --precision bf16 $BENCH --metrics-out /tmp/pipeexec_gpu_${s}_pp2.json || status=1
  done
else
  echo "(one GPU: NCCL needs one GPU per rank, so the multi-rank benchmark is skipped)"
fi
echo "== predicted vs measured on CPU/gloo, pp=4, one core per rank (this machine has the cores)"
timeout 200 python benchmarks/bench_prediction.py --pp 4 --steps 6 || status=1
python - <<'PY'
import glob, json, statistics
for f in sorted(glob.glob("/tmp/pipeexec_gpu_*.json")):
    m = json.load(open(f))
    t = statistics.median(m["step_times"][2:] or m["step_times"])
    print(f"{f}: median step {t*1e3:.1f} ms, tokens/s {statistics.median(m['tokens_per_s'][2:] or m['tokens_per_s']):,.0f}, "
          f"loss {m['losses'][0]:.3f} -> {m['losses'][-1]:.3f}")
PY
exit $status
