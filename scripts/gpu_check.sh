#!/usr/bin/env bash
# GPU check for pipeexec, for when a CUDA machine is lent (under 6 minutes on one GPU).
# One GPU runs world-size-1 checks only (NCCL refuses two ranks on one GPU); with two or more,
# every schedule also runs over NCCL against the CPU reference, lookahead 1 and 2.
#   bash scripts/gpu_check.sh            (from the repository root)
# Every python command below was run on CPU with --device cpu while it was written
# (scripts/gpu_check.py says what each check asserts).
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
echo "== devices and versions"
nvidia-smi --query-gpu=name,uuid,memory.total,driver_version --format=csv 2>/dev/null || echo "nvidia-smi unavailable"
python - <<'PY'
import torch
from pipeexec.launching.devices import cuda_device_count
from pipeexec.versions import SUPPORTED_TORCH, run_versions, torch_supported
print("versions", run_versions("nccl" if torch.cuda.is_available() else "gloo"),
      "NVML devices", cuda_device_count(), "supported range", SUPPORTED_TORCH, torch_supported())
PY
NGPU=$(python -c "from pipeexec.launching.devices import cuda_device_count; print(cuda_device_count())")
if [ "${NGPU:-0}" -lt 1 ]; then
  # every check below needs a GPU: one line, not a traceback per check
  echo "gpu_check: no CUDA device (NVML counts none: check the driver and CUDA_VISIBLE_DEVICES); nothing checked" >&2
  exit 2
fi
echo "== pp=1 profiles (zb-h1 vpp 1, zbv vpp 2): spans, memory meters, split probe"
timeout 150 python scripts/gpu_check.py profile --device cuda || status=1
echo "== fp16 with an injected overflow"
timeout 60 python scripts/gpu_check.py overflow --device cuda || status=1
echo "== save at step 3, resume to 6: identical losses, unchanged step time"
timeout 90 python scripts/gpu_check.py resume --device cuda || status=1
echo "== torchrun, one process, --device cuda"
timeout 60 torchrun --nproc-per-node 1 -m pipeexec train --schedule 1f1b --pp 1 --microbatches 4 \
    --layers 2 --hidden 128 --steps 3 --device cuda --no-progress \
    --metrics-out /tmp/pipeexec_gpu_torchrun.json || status=1
echo "== every schedule on one GPU (pp=1) against the CPU reference"
if [ "${NGPU:-0}" -ge 2 ]; then
  echo "== and over NCCL: every schedule at pp=2 (pp=4 with 4 GPUs), lookahead 1 and 2"
fi
timeout 420 python -m pytest -q -m cuda tests/exec -rs || status=1
exit $status
