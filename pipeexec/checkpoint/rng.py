"""Random number generator states (python, numpy, torch CPU, CUDA) as checkpointable values.

Saved per rank (each data-parallel replica has its own streams), so a resumed run draws the
same random numbers the uninterrupted run would have: dropout masks, any sampling. Values are
plain lists, ints and tensors so that ``torch.load(weights_only=True)`` accepts them.
"""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from .errors import CheckpointError


def capture_rng_state(device: torch.device | str | None = None) -> dict[str, Any]:
    """The current generator states of this process; CUDA's for ``device`` when it is a GPU."""
    version, mt, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    cuda = None
    if device is not None and torch.device(device).type == "cuda":
        cuda = torch.cuda.get_rng_state(torch.device(device))
    return {
        "python": [version, list(mt), gauss],
        "numpy": [str(np_name), [int(k) for k in np_keys], int(np_pos), int(np_has_gauss),
                  float(np_gauss)],
        "torch": torch.get_rng_state(),
        "cuda": cuda,
    }


def restore_rng_state(state: dict[str, Any], device: torch.device | str | None = None,
                      *, path: str | None = None) -> None:
    """Set every generator from ``state`` (as made by `capture_rng_state`)."""
    try:
        version, mt, gauss = state["python"]
        random.setstate((version, tuple(mt), gauss))
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(state["torch"])
        if state.get("cuda") is not None and device is not None \
                and torch.device(device).type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], torch.device(device))
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"unusable RNG state ({type(e).__name__}: {e})", path=path,
                              field="rng_state") from e
