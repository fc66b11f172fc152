# %% [markdown]
# # 03 · Real training on 4 CPU ranks, with a checkpoint and a resume
#
# `pipeexec` runs the very schedules that `pipesim` simulates, with `torch.distributed`
# (gloo on CPUs here, NCCL on GPUs). This notebook trains the built-in GPT for real, from the
# notebook, as 4 pipeline ranks (4 local processes forked by `pipeexec train --nproc 4`):
#
# 1. a 60-step run with the 1F1B schedule, and its loss curve;
# 2. the same job cut in two: 30 steps that save a checkpoint, then a resume that finishes
#    it, with losses identical to the uninterrupted run, bit for bit;
# 3. a resume of that checkpoint in a *different* layout, ZB-V on 2 ranks × 2 chunks.
#
# The model is tiny (6 blocks, width 64, sequences of 64 tokens) so that it trains in
# seconds on 2 CPU cores; the data are synthetic but learnable (arithmetic progressions
# modulo the vocabulary), so the loss visibly falls. All numbers here are **measured**.

# %%
%matplotlib inline
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

pd.set_option("display.width", 160)
WORK = Path(tempfile.mkdtemp(prefix="pipeexec-"))   # checkpoints and metrics go here
# One job: a GPT of 6 blocks, 8 microbatches of 1 sequence per step, learning rate warmed
# up over 5 steps then cosine-decayed over 60 (--decay-steps fixes the curve's length, so a
# run stopped after 30 steps and the first half of a 60-step run follow the same curve).
JOB = ["--microbatches", "8", "--layers", "6", "--hidden", "64", "--heads", "4",
       "--seq-len", "64", "--lr", "4e-3", "--min-lr", "4e-4", "--warmup-steps", "5",
       "--decay-steps", "60"]


def pipeexec_train(name, *args):
    """Run ``pipeexec train`` in local worker processes; return its metrics JSON."""
    metrics = WORK / f"{name}.json"
    cmd = [sys.executable, "-m", "pipeexec", "train", *JOB, *args, "--no-progress",
           "--metrics-out", str(metrics)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    shown = " ".join(shlex.quote(str(a)) for a in ["pipeexec", "train", *cmd[4:]]).replace(str(WORK) + "/", "")
    print("$", shown)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=WORK, env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"pipeexec train failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    lines = (proc.stdout + proc.stderr).splitlines()
    keep = [l for l in lines if not l.startswith("step ")]
    steps = [l for l in lines if l.startswith("step ")]
    print("\n".join(keep[:1] + steps[:1] + ["..."] + steps[-1:] + keep[1:]))
    print(f"({wall:.1f} s wall clock, process start-up included)")
    return json.loads(metrics.read_text())

# %% [markdown]
# ## 1. Train: 1F1B on 4 ranks, 60 steps

# %%
ref = pipeexec_train("reference", "--schedule", "1f1b", "--pp", "4", "--nproc", "4", "--steps", "60")

# %%
losses = pd.Series(ref["losses"], index=range(1, len(ref["losses"]) + 1), name="loss")
fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 3.8))
ax.plot(losses.index, losses, color="#3b75af", lw=1.2, label="loss (mean over the global batch)")
ax.plot(losses.index, losses.rolling(5, center=True, min_periods=1).mean(), color="k", lw=1, ls="--",
        label="centred moving average of 5")
ax.set_xlabel("step")
ax.set_ylabel("cross-entropy (nats / token)")
ax.set_title("1f1b, pp=4, m=8: training loss (measured)", fontsize=10)
ax.legend(fontsize=8)
ax.grid(alpha=0.3)
ms = pd.Series(ref["step_times"], index=losses.index) * 1e3
ax2.plot(ms.index, ms, ".-", color="#8a63b8", lw=0.8)
top = ms.iloc[1:].quantile(0.95) * 1.5
ax2.set_ylim(0, top)
clipped = ms[ms > top]                              # the first (warm-up) and any stalled step
ax2.set_xlabel("step")
ax2.set_ylabel("step time (ms)")
ax2.set_title("step time (measured; off the chart: "
              + ", ".join(f"step {k} {v:.0f} ms" for k, v in clipped.items()) + ")"
              if len(clipped) else "step time (measured)", fontsize=10)
ax2.grid(alpha=0.3)
fig.tight_layout()
print(f"loss {losses.iloc[0]:.3f} at step 1 -> {losses.iloc[-5:].mean():.3f} over the last 5 steps; "
      f"median step time {ms.iloc[1:].median():.0f} ms, "
      f"{pd.Series(ref['tokens_per_s']).iloc[1:].median():,.0f} tokens/s")
assert losses.iloc[0] > 5.0                         # about ln(256): a uniform guess
assert losses.iloc[-5:].mean() < losses.iloc[0] - 2.0

# %% [markdown]
# ## 2. Save, then resume
#
# The same job, stopped after 30 steps with a checkpoint (`--save`), then restarted with
# `--load` to run the remaining 30 (`--steps` is the total). A checkpoint holds the
# weights, the AdamW moments, the learning-rate schedule's position, the loss scale and the
# RNG states, one file per rank in Megatron-LM's layout, written to a temporary name and
# renamed into place.

# %%
first = pipeexec_train("first_half", "--schedule", "1f1b", "--pp", "4", "--nproc", "4",
                       "--steps", "30", "--save", "ckpt")
print()
print(subprocess.run([sys.executable, "-m", "pipeexec", "checkpoint", "inspect", "ckpt"],
                     cwd=WORK, capture_output=True, text=True, check=True).stdout)

# %%
resumed = pipeexec_train("resumed", "--schedule", "1f1b", "--pp", "4", "--nproc", "4",
                         "--steps", "60", "--load", "ckpt")
assert resumed["checkpoint"]["loaded_iteration"] == 30
assert first["losses"] + resumed["losses"] == ref["losses"]    # bit for bit
print("save + resume reproduces the uninterrupted run's 60 losses exactly")

# %% [markdown]
# ## 3. Resume in another layout
#
# A checkpoint stores every parameter under its global name, so it loads into any pipeline
# layout: here the 1F1B, 4-rank checkpoint continues as ZB-V on 2 ranks with 2 chunks each
# (the same 4 stages, placed in a V). The arithmetic is the same up to floating-point
# summation order, so the losses agree to about 1e-6.

# %%
moved = pipeexec_train("resumed_zbv", "--schedule", "zbv", "--pp", "2", "--vpp", "2", "--nproc", "2",
                       "--steps", "60", "--load", "ckpt")
assert moved["checkpoint"]["resharded"]
diff = max(abs(a - b) for a, b in zip(moved["losses"], ref["losses"][30:]))
print(f"largest loss difference from the uninterrupted 1f1b run: {diff:.2e}")
assert diff < 1e-4

# %%
fig, ax = plt.subplots(figsize=(8, 3.8))
ax.plot(losses.index, losses, color="#bbbbbb", lw=4, label="uninterrupted: 1f1b, pp=4, 60 steps")
ax.plot(range(1, 31), first["losses"], color="#3b75af", lw=1.2, label="steps 1-30: 1f1b, pp=4, --save")
ax.plot(range(31, 61), resumed["losses"], color="#4a9a52", lw=1.2, label="31-60: --load, same layout")
ax.plot(range(31, 61), moved["losses"], color="#e08b2d", lw=1, ls="--",
        label="31-60: --load as zbv, pp=2 x vpp=2")
ax.axvline(30.5, color="k", lw=0.8, ls=":")
ax.text(31, ax.get_ylim()[1] * 0.97, "checkpoint", fontsize=8, va="top")
ax.set_xlabel("step")
ax.set_ylabel("loss (measured)")
ax.set_title("one job, three ways: the curves lie on top of each other", fontsize=10)
ax.legend(fontsize=8)
ax.grid(alpha=0.3)
fig.tight_layout()
