# %% [markdown]
# # 02 · Pipeline timelines
#
# Every schedule of `pipesim` on the same job — GPT-3 6.7B on H100 presets, `pp = 4` ranks,
# `m = 8` microbatches — drawn as a Gantt chart (one row per rank; `F` forward, `B` full
# backward, `I` input gradient, `W` weight gradient; lighter shades are a rank's later
# chunks; the numbers are microbatches), with each rank's memory under it. Then the same
# step as a Chrome trace for [Perfetto](https://ui.perfetto.dev). All timings here are
# **simulated**.

# %%
%matplotlib inline
import json
import math
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
from IPython.display import display

import pipesim
from pipesim import CostModel

pd.set_option("display.width", 160)
pd.set_option("display.precision", 4)

PP, M, MODEL, HW = 4, 8, "gpt3-6.7b", "H100"
VPP = {"gpipe": 1, "1f1b": 1, "looped-bfs": 2, "interleaved": 2, "zb-h1": 1, "zb-h2": 1, "zbv": 2,
       "dualpipev": 2, "dualpipe": 1, "v-half": 2, "v-min": 2, "zb-auto": 1}
# vpp is the model parts per rank: dualpipe cuts the model into PP parts (v = 1) and each rank
# also holds a copy of another part, so its schedule has two stages per rank
assert set(VPP) == set(pipesim.schedule_names()), "a new schedule? add it to VPP"


def options(name, costs):
    """zb-auto searches with the job's own costs, under 1F1B's peak memory (ZB-1p's budget)."""
    if name != "zb-auto":
        return {}
    return {"costs": costs, "memory_limit": max(results["1f1b"].peak_memory)}


results = {}
for name, v in VPP.items():
    costs = CostModel.transformer(MODEL, HW, num_stages=PP * v)    # per model part
    schedule = pipesim.build_schedule(name, pp=PP, microbatches=M, vpp=v, **options(name, costs))
    results[name] = pipesim.simulate(schedule, costs)

GB = 1e9
overview = pd.DataFrame({
    name: {"vpp": r.schedule.parts_per_rank, "makespan (ms)": r.makespan * 1e3,
           "bubble_fraction": r.bubble_fraction, "bubble_rate": r.bubble_rate,
           "peak memory (GB, worst rank)": max(r.peak_memory) / GB,
           "peak in-flight (worst rank)": max(r.peak_inflight)}
    for name, r in results.items()}).T.sort_values("makespan (ms)")
overview = overview.astype({"vpp": int, "peak in-flight (worst rank)": int})
overview

# %% [markdown]
# ## All schedules on one time axis
#
# The same work on every row of charts; what differs is only the order of the actions, and
# so where the idle gaps (light grey) fall.

# %%
span = max(r.makespan for r in results.values())
fig, axes = plt.subplots(len(results), 1, figsize=(14, 1.45 * len(results)), sharex=True)
for ax, (name, r) in zip(axes, results.items()):
    r.gantt(ax=ax, xlim=(0, span), labels=False,
            title=f"{name} (v={r.schedule.parts_per_rank}): {r.makespan * 1e3:.0f} ms, "
                  f"bubble_fraction {r.bubble_fraction:.3f}")
    ax.set_xlabel("")
axes[-1].set_xlabel("time (s, simulated)")
fig.tight_layout()

# %% [markdown]
# ## Each schedule, with its memory
#
# Under each chart: the bytes every rank holds (weights, gradients and optimizer state, plus
# the activations of the microbatches in flight). GPipe and the breadth-first loop hold all
# `m` microbatches at the peak; 1F1B only `pp - r` on rank `r`; ZB-H2 buys its empty
# cool-down with a longer warm-up, and so more memory; ZB-V's V placement evens out the ranks.
# DualPipeV runs most forwards and backwards as overlapped pairs (`OVERLAP_F_B`, drawn as
# their F and B back to back); DualPipe (DeepSeek's bidirectional original) feeds half the
# microbatches at rank 0 and half at rank 3, the second half (their own numbers, 4-7) going
# up through copies of the parts (the lighter boxes: each rank's second stage), for twice the
# weights per rank; V-Half and V-Min hold about
# a half and a third of 1F1B's activations; zb-auto is the Zero Bubble search under 1F1B's peak.

# %%
for name, r in results.items():
    fig = r.gantt(memory=True)
    display(fig)
    plt.close(fig)

# %% [markdown]
# ## Communication
#
# With `comm=True` a thin lane under each rank shows its transfers (sends) and the time it
# waited on a receive. Here the stages' activations (2048 × 4096 bf16 values, 16.8 MB) cross
# a 50 GB/s network link, about 0.35 ms each: small next to a 14 ms forward, but on the
# critical path of every warm-up step.

# %%
r = results["1f1b"]
fig = r.gantt(comm=True, xlim=(0, r.makespan * 0.35), labels=True,
              title="1f1b, first third of the step, with the communication lanes (simulated)")
display(fig)
plt.close(fig)
sends = r.trace[r.trace["op"].isin(["SEND_F", "SEND_B"])]
print(f"{len(sends)} transfers, {sends['bytes'].iloc[0] / 1e6:.1f} MB each, "
      f"{(sends['end'] - sends['start']).mean() * 1e3:.3f} ms each on the link")
r.summary()

# %% [markdown]
# ## When a transfer starts: posting receives early
#
# The charts above assume a receive is always posted (`comm="async"`). gloo and NCCL start a
# point-to-point transfer only once *both* sides have posted (`comm="rendezvous"`). A RECV
# right before the computation that needs its data (the schedule's default) then always waits
# the whole transfer; `recv_lookahead=k` posts it `k` computations earlier, and the transfer
# overlaps them (the computation still waits for the data where it needs it, so no bubble
# cascades). `pipeexec` runs with `recv_lookahead=1`.

# %%
posting = {}
for name, v in VPP.items():
    schedule = results[name].schedule
    costs = CostModel.transformer(MODEL, HW, num_stages=schedule.num_parts)
    posting[name] = {
        "receives pre-posted (async), ms": results[name].makespan * 1e3,
        "rendezvous, posted right before, ms": pipesim.simulate(schedule, costs, comm="rendezvous").makespan * 1e3,
        "rendezvous, one computation early, ms": pipesim.simulate(
            schedule.with_recv_lookahead(1), costs, comm="rendezvous").makespan * 1e3,
    }
posting = pd.DataFrame(posting).T
posting["cost of posting late"] = (posting.iloc[:, 1] / posting.iloc[:, 0] - 1).map("{:+.1%}".format)
posting

# %% [markdown]
# ## Overlapping a forward with a backward, trading memory for bubble
#
# DualPipeV's steady state is pairs of a forward and a backward of two microbatches run as one
# action; what the pair gains depends on what the device can hide (DeepSeek overlaps one
# part's all-to-all with the other's compute). `CostModel.overlap_factor` says how long a pair
# takes relative to its parts run in turn (1.0: no gain). V-Half and V-Min trade bubble for
# memory on purpose; zb-auto searches for the fastest order that fits a memory budget.

# %%
base = CostModel.transformer(MODEL, HW, num_stages=2 * PP)
trade = {}
for factor in (1.0, 0.8, 0.6):
    r = pipesim.simulate(results["dualpipev"].schedule, base.with_(overlap_factor=factor))
    trade[f"dualpipev, overlap_factor {factor}"] = r
parts = CostModel.transformer(MODEL, HW, num_stages=PP)     # dualpipe: PP parts, each held twice
for factor in (1.0, 0.6):
    r = pipesim.simulate(results["dualpipe"].schedule, parts.with_(overlap_factor=factor))
    trade[f"dualpipe, overlap_factor {factor}"] = r
for name in ("1f1b", "zbv", "v-half", "v-min", "zb-h1", "zb-h2", "zb-auto"):
    trade[name] = results[name]


def activation_peak(r):
    """Worst rank's peak bytes less what it holds all step (weights, gradients, optimizer)."""
    s, c = r.schedule, r.costs
    held = c.stage_values("stage_static_bytes", s.num_stages)
    static = [c.rank_static_bytes(PP)[k] + sum(held[st] for st in s.rank_stages(k)) for k in range(PP)]
    return max(p - q for p, q in zip(r.peak_memory, static))


def weights(r):
    """Worst rank's weights, gradients and optimizer state (a copy of a part counts again)."""
    held = r.costs.stage_values("stage_static_bytes", r.schedule.num_stages)
    return max(sum(held[st] for st in r.schedule.rank_stages(k)) for k in range(PP))


trade = pd.DataFrame({
    name: {"makespan (ms)": r.makespan * 1e3, "bubble_rate": r.bubble_rate,
           "activation peak / 1F1B's": activation_peak(r) / activation_peak(results["1f1b"]),
           "weights / 1F1B's": weights(r) / weights(results["1f1b"])}
    for name, r in trade.items()}).T
trade

# %%
r = pipesim.simulate(results["dualpipev"].schedule, base.with_(overlap_factor=0.6))
fig = r.gantt(memory=True, title="dualpipev, F&B pairs at 0.6x their parts' time (simulated)")
display(fig)
plt.close(fig)
r = pipesim.simulate(results["dualpipe"].schedule, parts.with_(overlap_factor=0.6))
fig = r.gantt(memory=True, title="dualpipe (both directions), F&B pairs at 0.6x (simulated)")
display(fig)
plt.close(fig)

# %% [markdown]
# ## A Chrome trace for Perfetto
#
# `SimResult.to_chrome_trace(path)` writes the step as Chrome trace-event JSON: one process
# per rank, a compute thread and one thread per link, and a flow arrow from every send to
# its receive. Open the file at <https://ui.perfetto.dev> (or `chrome://tracing`). A measured
# run from `pipeexec` writes the same format.

# %%
out_dir = Path(tempfile.mkdtemp(prefix="pipesim-"))
path = out_dir / "zbv_pp4_m8.json"
data = results["zbv"].to_chrome_trace(path)
events = json.loads(path.read_text())["traceEvents"]
kinds = pd.Series([e["ph"] for e in events]).value_counts()
print(f"wrote {path} ({path.stat().st_size / 1e3:.0f} kB): {len(events)} events")
print(kinds.rename({"X": "spans (X)", "M": "metadata (M)", "s": "flow starts (s)",
                    "f": "flow ends (f)"}).to_string())
assert kinds["X"] == len(results["zbv"].trace)
assert kinds["s"] == kinds["f"] == (results["zbv"].trace["op"].astype(str).str.startswith("SEND")).sum()
[e for e in events if e["ph"] == "X"][:2]

# %% [markdown]
# ## What the pictures say, checked
#
# The facts the charts show, asserted so that this notebook fails if the simulator ever
# stops showing them.

# %%
ms = {n: r.makespan for n, r in results.items()}
mem = {n: max(r.peak_memory) for n, r in results.items()}
assert math.isclose(ms["gpipe"], ms["1f1b"])       # same bubble...
assert mem["gpipe"] > mem["1f1b"]                   # ...for far more memory
assert ms["interleaved"] < ms["1f1b"]               # interleaving shortens the bubble
assert ms["zb-h1"] < ms["1f1b"] and mem["zb-h1"] <= mem["1f1b"] * 1.1
hand = {n: ms[n] for n in ms if n not in ("dualpipev", "dualpipe", "zb-auto")}
assert ms["zbv"] == min(hand.values())              # ZB-V is the fastest hand-drawn one here
assert ms["zb-auto"] <= min(ms[n] for n in ms if mem[n] <= mem["1f1b"])  # the search: no
                                                    # schedule within its budget beats it
act = trade["activation peak / 1F1B's"]
assert act["v-min"] < act["v-half"] < act["1f1b"]   # memory traded on purpose...
assert ms["v-min"] < ms["1f1b"] and ms["v-half"] < ms["1f1b"]   # ...and still less bubble
dual = trade.filter(like="dualpipev", axis=0)["makespan (ms)"]
assert dual.is_monotonic_decreasing                 # the better the overlap, the shorter
both = trade.filter(like="dualpipe,", axis=0)
assert both["makespan (ms)"].is_monotonic_decreasing
assert math.isclose(both["weights / 1F1B's"].iloc[0], 2.0, rel_tol=0.05)   # two copies (the
                                                    # first and last parts hold embedding, head)
assert ms["dualpipe"] < ms["1f1b"]                  # both ends fed: a shorter bubble
late, early = posting.iloc[:, 1], posting.iloc[:, 2]
assert (late >= posting.iloc[:, 0] * (1 - 1e-12)).all()   # waiting for the receiver costs time
assert (early <= late * (1 + 1e-12)).all()          # which posting a computation early gives back
print("fastest to slowest:", " < ".join(sorted(ms, key=ms.get)))
