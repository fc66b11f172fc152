"""What communication overlapped with compute adds to it: Calculon's model.

A collective running under compute is not free: NCCL's kernels hold SMs (over NVLink they move
the data themselves) and memory bandwidth, so the compute it hides under runs as if it had
``1 - u`` of the GPU while both run, ``u`` the hardware's processor usage of the link
(``Hardware.link_processor_usage`` / ``network_processor_usage``; Calculon, calculon-ai/calculon
commit caa4b11, ``calculon/llm/layers.py`` ``compute_processing_time``, and its ``llm.py`` for
the data-parallel overlap). For communication ``c`` under a window ``w`` of compute, the time
beyond the compute:

* ``c`` fits (``c <= w / (1 - u)``): the compute slowed, ``c * u``;
* ``c`` does not: the excess shows, ``c - w``,

continuous where the two meet. Cut in ``T`` tiles (Megatron's userbuffers split a
tensor-parallel GEMM ``g`` and its all-gather / reduce-scatter in ``tp`` chunks, Calculon's
"ring" overlap: chunk ``i + 1``'s transfer runs under chunk ``i``'s GEMM, the first chunk on
local data, so the ``T - 1`` transfers that make ``c`` hide under ``T - 1`` of the ``T``
chunks), the window is ``w = (T - 1) / T * g``; untiled (a transfer that runs all along, as
the data-parallel reduce under the backward) ``w = g``.
"""
from __future__ import annotations

from .cluster import Link


def usage(link: Link, hw) -> float:
    """The fraction of compute a collective on ``link`` takes while hidden (``hw``'s figure
    for the link's kind)."""
    return hw.link_processor_usage if link.kind == "intra" else hw.network_processor_usage


def added(comm: float, compute: float, u: float, tiles: int = 0) -> float:
    """Seconds that ``comm`` overlapped with ``compute`` adds to ``compute`` (the module's
    docstring); with no compute to hide under, all of ``comm``."""
    if comm <= 0:
        return 0.0
    window = compute * (tiles - 1) / tiles if tiles >= 1 else compute
    if window <= 0:
        return comm
    return comm - window if comm * (1 - u) > window else comm * u
