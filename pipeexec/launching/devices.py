"""Which device each rank uses, decided without poisoning forked workers.

* Counting GPUs goes through NVML (`cuda_device_count`), never through the CUDA runtime: once a
  parent has initialised CUDA, a forked child cannot use it ("Cannot re-initialize CUDA in
  forked subprocess"). A local run that may use CUDA starts its workers with "spawn"
  (`start_method_for`); a CPU run keeps the fast fork.
* ``--device cuda`` means ``cuda:LOCAL_RANK % count``: with one visible GPU per process
  (``CUDA_VISIBLE_DEVICES`` per rank, SLURM ``--gpus-per-task=1``) every rank gets ``cuda:0`` of
  its own view, which is a different GPU. Two ranks really sharing a GPU (``--device cuda:0``
  with several ranks, more ranks than GPUs) are found by GPU UUID through the store
  (`check_unique_gpus`) and refused with the reason, before NCCL would die in its init.
"""
from __future__ import annotations

import datetime
import os

import torch


class DeviceError(RuntimeError):
    """A device layout NCCL cannot run (two ranks on one GPU, no GPU ...)."""


def cuda_device_count() -> int:
    """GPUs visible to this process, counted through NVML (CUDA stays uninitialised); 0 when
    there is no NVML (no NVIDIA driver) or torch has no CUDA."""
    if not torch.backends.cuda.is_built():
        return 0
    try:
        n = torch.cuda._device_count_nvml()    # respects CUDA_VISIBLE_DEVICES
    except Exception:   # noqa: BLE001  (no NVML: no NVIDIA driver)
        return 0
    return max(0, int(n))


def may_use_cuda(device: str | None, backend: str | None) -> bool:
    """Whether a run with these settings may put a rank on a GPU."""
    if device is not None:
        return torch.device(device).type == "cuda"
    return backend == "nccl" or cuda_device_count() > 0


def start_method_for(device: str | None, backend: str | None) -> str:
    """"spawn" whenever CUDA may be used (a forked child cannot initialise it once the parent
    has), else the fast "fork"."""
    return "spawn" if may_use_cuda(device, backend) else "fork"


def pick_device(local_rank: int, device: str | None, count: int | None = None) -> torch.device:
    """This rank's device: ``cuda`` -> ``cuda:local_rank % count``; ``None`` -> that when a GPU
    is visible, else ``cpu``; anything else as given."""
    if device is not None and torch.device(device).type != "cuda":
        return torch.device(device)
    if device is not None and torch.device(device).index is not None:
        return torch.device(device)
    count = cuda_device_count() if count is None else count
    if count == 0:
        if device is None:
            return torch.device("cpu")
        raise DeviceError(f"--device {device}: no CUDA device is visible to local rank "
                          f"{local_rank} (NVML counts none; check CUDA_VISIBLE_DEVICES)")
    return torch.device("cuda", local_rank % count)


def gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def check_unique_gpus(store, rank: int, world: int, uuid: str, timeout: float) -> None:
    """Every rank publishes its GPU's UUID in the store and reads everyone's; two ranks on one
    GPU raise `DeviceError` naming both (NCCL cannot run two ranks of a group on one GPU).
    Keys carry torchrun's restart count, so a restarted job never reads its previous round's."""
    key = f"gpu-uuid/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    store.set(key + str(rank), uuid)
    store.wait([key + str(r) for r in range(world)], datetime.timedelta(seconds=timeout))
    seen: dict[str, int] = {}
    for r in range(world):
        u = store.get(key + str(r)).decode()
        if u in seen:
            raise DeviceError(f"rank {rank}: ranks {seen[u]} and {r} are on the same GPU ({u}); "
                              "NCCL needs one GPU per rank: start at most one rank per GPU, "
                              "use --device cuda (cuda:LOCAL_RANK % GPUs) rather than a fixed "
                              "cuda:N, or --device cpu for gloo")
        seen[u] = r
