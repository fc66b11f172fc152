"""pipeexec.malloc: with freed memory kept, buffers freed and asked for again (a stage's
activations, step after step) come back without page faults; glibc's default gives them to the
kernel and faults again. Fresh interpreters, so the test process's own allocator is untouched."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

SCRIPT = """
import json, resource, sys, torch
from pipeexec.malloc import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
faults = []
for _ in range(3):                                # "steps": hold 12 buffers, then free them all
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    held = [torch.empty(2 ** 19 * (1 + k % 3)).fill_(1.0) for k in range(12)]   # 2, 4, 6 MiB
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    del held
print(json.dumps({"applied": applied, "faults": faults}))
"""
PAGES = 48 * 2 ** 20 // 4096                      # every page of the 12 buffers


def run(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_freed_memory_is_reused_without_page_faults():
    kept, default = run("keep"), run("default")
    assert kept["applied"] is True
    # first request: fresh pages either way
    assert kept["faults"][0] > PAGES // 2 and default["faults"][0] > PAGES // 2
    # then the kept heap serves them again: at most a buffer's worth of fresh pages (the
    # heap's free space is not always in one piece), against nearly all of them by default
    assert max(kept["faults"][1:]) < PAGES // 4
    # glibc's default maps each buffer on its own and unmaps it when freed: the next step
    # touches fresh pages again
    assert default["faults"][1] > PAGES // 2
