"""Keep freed host memory in the process (glibc malloc), so a CPU step does not page-fault.

Why: torch's CPU allocator gets its buffers from malloc, and glibc serves large requests
(above a threshold that starts at 128 KiB) with fresh ``mmap`` pages and gives them back to the
kernel when they are freed (it raises the threshold as it goes, but not for every pattern). A
pipeline stage frees its activations at every backward and asks for them again at the next
forward, so steps keep touching fresh pages: on the development machine a 2-block forward of
the built-in GPT took 28 ms with ~4,600 page faults and 21 ms without them, and each rank of a
2-rank GPipe run took 2,000 to 40,000 page faults per step (none after the second step with
this setting). Worse for prediction, how many pages are fresh depends on how much memory the
schedule already holds (GPipe's last forwards and first backwards are the slow ones), a cost no
per-stage model carries. Serving everything up to 32 MiB from the heap and never trimming it
keeps freed memory for the next request, as a GPU caching allocator does: resident memory
stays at the step's peak instead of returning to the kernel between steps.

``keep_freed_memory()`` applies it to the calling process (a worker, before its first step);
it does nothing off glibc. ``TrainConfig.cpu_keep_freed_memory`` (on by default) has the
trainer call it for CPU runs.
"""
from __future__ import annotations

import ctypes

# mallopt parameters (glibc malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): larger requests
# still get their own mapping.
MMAP_THRESHOLD = 32 * 1024 * 1024
# Never give the top of the heap back (fits a C int, as mallopt takes).
TRIM_THRESHOLD = 2 ** 31 - 1


def keep_freed_memory() -> bool:
    """Tune this process's malloc as the module docstring says; True when it was applied
    (glibc's mallopt found and both settings accepted). The process's own symbols hold the C
    library's: no ``ctypes.util.find_library``, which runs ``ldconfig -p`` on every call (a
    worker calls this for every trainer it assembles)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and \
        bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
