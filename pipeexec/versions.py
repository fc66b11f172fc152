"""The torch and NCCL versions a run used (recorded in its metrics), and the torch range the
NCCL path is written for.

Why a range: the NCCL path depends on how torch maps process groups to communicators and
streams. torch 2.6-2.7 create a 2-rank communicator lazily at a group's first p2p operation,
blocking until both ranks arrive (pipeexec warms every channel up in one global order at start,
`pipeexec.topology.warm_up_channels`); torch >= 2.8 with ``device_id`` create them eagerly and
run every p2p operation of a group on its one communicator's stream (pipeexec gives each
channel its own 2-rank group, so a stream carries one kind one way). Before 2.6,
``work.wait(timeout)`` on NCCL ignores its timeout. The upper bound is the newest torch this
project has tested (the ``exec`` extra in pyproject.toml says the same).
"""
from __future__ import annotations

import torch

SUPPORTED_TORCH = ((2, 6), (2, 14))     # [lower, upper): the ``exec`` extra's bound


def torch_version_tuple(version: str | None = None) -> tuple[int, int]:
    text = (version or torch.__version__).split("+")[0]
    major, minor = text.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def torch_supported(version: str | None = None) -> bool:
    lo, hi = SUPPORTED_TORCH
    return lo <= torch_version_tuple(version) < hi


def run_versions(backend: str) -> dict:
    """torch, CUDA and NCCL versions of this process (NCCL only on the nccl backend)."""
    nccl = None
    if backend == "nccl":
        v = torch.cuda.nccl.version()
        nccl = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl,
            "torch_supported": torch_supported()}
