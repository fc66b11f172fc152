"""pipeexec tp 2 x pp 2 vs torch.distributed.pipelining + DTensor tensor parallelism, side by side
in one run (CPU / gloo, 4 forked ranks).

Both sides: the built-in GPT cut at the same stage boundaries, the same ranks (Megatron's order,
tp fastest: rank = pp_rank * tp + tp_rank), the same microbatches, data and schedule; every block
tensor-parallel over the two ranks of its pipeline position (QKV and fc1 column-parallel, the
attention output projection and fc2 row-parallel, attention on the local heads).

* pipeexec: ``init_topology(pp, 1, tp=2)``, the GPT built with its ``TensorParallel`` group
  (`pipeexec.parallel`: its own autograd regions; embedding and head cut over the vocabulary,
  vocab-parallel cross-entropy), `PipelineRuntime` as in bench_exec_vs_torch.py.
* torch: the whole (tp 1) stages, each block cut by
  ``parallelize_module(block, mesh["tp"], {qkv, fc1: ColwiseParallel, proj, fc2: RowwiseParallel})``
  over ``init_device_mesh("cpu", (pp, tp), mesh_dim_names=("pp", "tp"))``, the block's head count
  set to ``heads // tp`` (torch's TP tutorial's ``n_heads``), its stages in ``PipelineStage``s on
  ``mesh["pp"]``'s group and torch's schedule class. The fused QKV weight's rows are first put in
  rank-major order ([q_r; k_r; v_r] for each tp rank r, a permutation of the same parameter) so
  that ColwiseParallel's contiguous row cut gives each rank its heads' q, k and v, as
  pipeexec's ``ShardSpec(0, groups=3)`` does. ``--torch-head``: ``replicated`` (the
  embedding and head whole on both tp ranks, the plain loss) or ``vocab-parallel`` (default; lm_head
  ColwiseParallel with its logits left sharded and the loss under ``loss_parallel()``, as
  pipeexec's head).

Each timed step is one pipeline forward + backward over the global batch (no optimizer), the
two executors alternating step by step (bench_exec_vs_torch.time_rounds). Before the table: the
first step's mean loss of each (they must agree within fp32 tolerance), then every step's
microbatch losses are compared (rtol 1e-5). Idle share as in bench_exec_vs_torch.py (pipeexec's
own stages computed at once on every rank, no pipeline).

    OMP_NUM_THREADS=1 python benchmarks/bench_exec_vs_torch_tp.py
    OMP_NUM_THREADS=1 python benchmarks/bench_exec_vs_torch_tp.py --schedules 1f1b --profile

``--profile``: after the timed rounds, one more step of each executor under
``torch.profiler`` on every rank; prints, per executor, the slowest rank's total time in each
kind of operation (compute, collectives, p2p waits) so that a ratio above 1.0 can be explained.

Target: pipeexec's step time at or below torch's (ratio <= 1.0).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_exec_vs_torch import (SCHEDULES, add_model_args, busy_runner,  # noqa: E402
                                 pipeexec_runner, print_table, summary_row,
                                 time_rounds, torch_runner)

from pipeexec import launch  # noqa: E402
from pipeexec.config import GPT_MODEL  # noqa: E402
from pipeexec.data import BatchSource  # noqa: E402
from pipeexec.model import Block, Head, gpt_stack  # noqa: E402
from pipeexec.parallel.regions import TensorParallel  # noqa: E402
from pipeexec.partition import by_layers  # noqa: E402
from pipeexec.pipeline.stage import build_stage  # noqa: E402
from pipeexec.topology import destroy_topology, init_topology  # noqa: E402

DEFAULT_SCHEDULES = "1f1b,interleaved,zbv"


def qkv_rank_major(lin: torch.nn.Linear, tp: int) -> None:
    """Reorder a fused [q; k; v] projection's output rows to [q_0; k_0; v_0; q_1; k_1; v_1; ...]
    (q_r: tp rank r's heads), so a contiguous cut into tp row blocks gives each rank its own
    heads' q, k and v. The same parameter values, permuted; the output is permuted alike."""
    out = lin.weight.shape[0]
    with torch.no_grad():
        w = lin.weight.view(3, tp, out // (3 * tp), -1).transpose(0, 1).reshape_as(lin.weight)
        lin.weight.copy_(w.clone())
        if lin.bias is not None:
            b = lin.bias.view(3, tp, out // (3 * tp)).transpose(0, 1).reshape_as(lin.bias)
            lin.bias.copy_(b.clone())


def torch_tensor_parallel(stage: torch.nn.Module, tp_mesh, tp: int, head: str) -> None:
    """Cut ``stage``'s blocks (and, ``head == "vocab-parallel"``, its LM head) with torch's
    DTensor tensor parallelism over ``tp_mesh``."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    for layer in stage.layers.values():
        if isinstance(layer, Block):
            qkv_rank_major(layer.qkv, tp)
            layer.heads //= tp                 # attention over this rank's heads
            parallelize_module(layer, tp_mesh, {"qkv": ColwiseParallel(),
                                                "proj": RowwiseParallel(),
                                                "fc1": ColwiseParallel(),
                                                "fc2": RowwiseParallel()})
        elif isinstance(layer, Head) and head == "vocab-parallel":
            parallelize_module(layer, tp_mesh, {"lm_head": ColwiseParallel(
                output_layouts=Shard(-1), use_local_output=False)})


# -- profile --------------------------------------------------------------------------------------
# What each kind of operator is; self CPU time, so a Python autograd function that waits on a
# collective inside (pipeexec's tp regions) counts its wait there.
KINDS = (
    ("tp collective", ("_reducefrom", "_copyto", "_gathersequence", "_reducescatter",
                       "_scattersequence", "wait_tensor", "c10d::allreduce", "c10d::allgather",
                       "c10d::reduce_scatter", "_c10d_functional::", "all_reduce", "all_gather",
                       "reduce_scatter")),
    ("p2p", ("recv", "send", "pipeexec.p2p")),
    ("dtensor dispatch", ("pythonsubclass", "_fromtorchtensor", "_totorchtensor", "redistribute",
                          "dtensor")),
    ("pp schedule", ("pp:",)),
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm")),
    ("attention", ("scaled_dot_product", "flash_attention")),
    ("loss", ("crossentropy", "cross_entropy", "log_softmax", "nll_loss")),
)


def _kind(name: str) -> str:
    n = name.lower()
    for kind, keys in KINDS:
        if any(n.startswith(k) if k.endswith(":") else k in n for k in keys):
            return kind
    return "other"


@contextlib.contextmanager
def _quiet_stderr():
    """The profiler's C++ start/stop lines (USDT:...) kept off the table."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def profile_step(fn, step: int) -> dict:
    """One step of ``fn`` under torch.profiler: self CPU time (s) of each kind of operator,
    the number of operator calls, the top self-time operators, and the step's wall time."""
    from torch.profiler import ProfilerActivity, profile
    dist.barrier()
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        fn(step)
        wall = time.perf_counter() - t0
    kinds: dict[str, float] = defaultdict(float)
    ops, calls = [], 0
    for e in prof.key_averages():
        self_s = e.self_cpu_time_total / 1e6
        kinds[_kind(e.key)] += self_s
        calls += e.count
        ops.append((self_s, e.count, e.key))
    ops.sort(reverse=True)
    return {"wall": wall, "kinds": dict(kinds), "calls": calls, "top": ops[:10]}


# -- worker ---------------------------------------------------------------------------------------
def worker(board, args) -> list[dict]:
    import pipesim
    import torch.distributed.pipelining as tpp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    tp_size = args.tp
    topo = init_topology(args.pp, 1, tp=tp_size, timeout=300)
    mesh = init_device_mesh("cpu", (args.pp, tp_size), mesh_dim_names=("pp", "tp"))
    # the same layout: tp the inner dimension of torch's mesh, as in pipeexec's
    here = (mesh["pp"].get_local_rank(), mesh["tp"].get_local_rank())
    assert here == (topo.pp_rank, topo.tp_rank), (str(topo), here)
    model = GPT_MODEL.with_(layers=args.layers, hidden=args.hidden, heads=args.heads,
                            seq_length=args.seq_len, vocab=args.vocab)
    tp = TensorParallel(topo.tp_group, tp_size, topo.tp_rank)
    spec_tp = gpt_stack(model, tp)            # pipeexec's tensor-parallel GPT
    spec = gpt_stack(model)                   # the whole GPT, cut by DTensor for torch
    src = BatchSource(seed=0, seq_len=args.seq_len, vocab=args.vocab,
                      global_batch=args.microbatches * args.micro_batch_size)
    cpu = torch.device("cpu")
    vocab_parallel = args.torch_head == "vocab-parallel"
    loss_ctx = loss_parallel if vocab_parallel else contextlib.nullcontext
    rows = []
    try:
        for name, vpp, torch_name in SCHEDULES:
            if name not in args.schedules.split(","):
                continue
            schedule = pipesim.build_schedule(name, pp=args.pp, microbatches=args.microbatches,
                                              vpp=vpp, recv_lookahead=args.recv_lookahead
                                              ).validate()
            bounds = by_layers(spec.num_layers, schedule.num_stages)
            mine = {s: build_stage(spec_tp, s, bounds, seed=0, device=cpu, dtype=torch.float32)
                    for s in schedule.rank_stages(topo.pp_rank)}
            theirs = {s: build_stage(spec, s, bounds, seed=0, device=cpu, dtype=torch.float32)
                      for s in mine}
            for st in theirs.values():
                torch_tensor_parallel(st, mesh["tp"], tp_size, args.torch_head)
            stages = [tpp.PipelineStage(theirs[s], s, schedule.num_stages, cpu,
                                        group=mesh["pp"].get_group())
                      for s in sorted(theirs)]
            cls = getattr(tpp, torch_name)
            tsched = cls(stages[0] if vpp == 1 else stages, n_microbatches=args.microbatches,
                         loss_fn=spec.loss_fn)
            run_torch = torch_runner(tsched, theirs, src, 0 in theirs,
                                     schedule.num_stages - 1 in theirs)

            def run_theirs(step, run_torch=run_torch):
                with loss_ctx():
                    return run_torch(step)
            runs = (("pipeexec", pipeexec_runner(schedule, topo, mine, spec_tp.loss_fn, src,
                                                 args.microbatches, cpu)),
                    ("torch", run_theirs),
                    ("busy", busy_runner(mine, spec_tp.loss_fn, src, args.microbatches,
                                         args.hidden, schedule.num_stages)))
            # The first step alone, its losses printed before any timing (rank 0 prints)
            first = {who: fn(0) for who, fn in runs[:2]}
            got = [None] * topo.world_size
            dist.all_gather_object(got, (first["pipeexec"], first["torch"]))
            held = [g for g in got if g[0]]
            if topo.rank == 0:
                (a, b) = held[0]
                ma, mb = sum(a) / len(a), sum(b) / len(b)
                print(f"{name:<12} first step mean loss: pipeexec {ma:.7f}  torch {mb:.7f}  "
                      f"rel. diff {abs(ma - mb) / abs(mb):.1e}  (max over microbatches "
                      f"{max(abs(u - v) / abs(v) for u, v in zip(a, b)):.1e}; "
                      f"{len(held)} ranks hold the loss, all equal: "
                      f"{all(h == held[0] for h in held)})",
                      flush=True)
            times, losses = time_rounds(runs, args.warmup, args.steps)
            row = summary_row(name, vpp, torch_name, times, losses)
            if args.profile:
                row["profile"] = {who: profile_step(fn, args.warmup + args.steps)
                                  for who, fn in runs[:2]}
            rows.append(row)
            del tsched, stages
    finally:
        destroy_topology(topo)
    return rows


def print_profiles(per_rank: list[list[dict]]) -> None:
    n = len(per_rank)
    print(f"\nprofile: one more step of each under torch.profiler (slower than unprofiled); "
          f"self CPU time in s by kind of operator, ranks r0..r{n - 1}")
    for i, row in enumerate(per_rank[0]):
        if "profile" not in row:
            continue
        for who in ("pipeexec", "torch"):
            profs = [rows[i]["profile"][who] for rows in per_rank]
            print(f"{row['schedule']:<12} {who:<9} {'wall':<17}"
                  + " ".join(f"{p['wall']:>6.3f}" for p in profs))
            for kind in [k for k, _ in KINDS] + ["other"]:
                if any(p["kinds"].get(kind) for p in profs):
                    print(f"{'':<22} {kind:<17}" + " ".join(f"{p['kinds'].get(kind, 0.0):>6.3f}"
                                                        for p in profs))
            print(f"{'':<22} {'operator calls':<17}" + " ".join(f"{p['calls']:>6d}" for p in profs))
    for i, row in enumerate(per_rank[0]):
        if "profile" not in row:
            continue
        for who in ("pipeexec", "torch"):
            print(f"{row['schedule']} {who}: top self-time operators on rank 0 (s, calls)")
            for self_s, count, key in per_rank[0][i]["profile"][who]["top"]:
                print(f"    {self_s:8.3f} {count:6d}  {key[:90]}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    add_model_args(p)
    p.add_argument("--schedules", default=DEFAULT_SCHEDULES, help="comma-separated subset of "
                   + ",".join(n for n, _, _ in SCHEDULES))
    p.add_argument("--torch-head", choices=("replicated", "vocab-parallel"),
                   default="vocab-parallel",
                   help="torch's embedding and LM head: whole on every tp rank, or the LM head "
                   "ColwiseParallel with loss_parallel (pipeexec's are always vocab-parallel)")
    p.add_argument("--cpus-per-rank", type=float, default=None,
                   help="a cgroup CPU quota per rank (pipeexec.launching.cpu_quota)")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)
    print("$ " + " ".join(shlex.quote(a) for a in
                          [f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')}", "python"]
                          + sys.argv), flush=True)
    world = args.pp * args.tp
    print(f"tp={args.tp} x pp={args.pp} ({world} ranks) m={args.microbatches} "
          f"b={args.micro_batch_size} GPT layers={args.layers}+2 hidden={args.hidden} "
          f"heads={args.heads} seq={args.seq_len} vocab={args.vocab}; torch head "
          f"{args.torch_head}; CPU/gloo, {torch.__version__}, {os.cpu_count()} CPUs, "
          f"cpus/rank {args.cpus_per_rank}; median of {args.steps} steps after {args.warmup} "
          "warm-up (fwd+bwd, no optimizer)", flush=True)
    per_rank = launch(worker, world, (args,), timeout=3000, cpus_per_rank=args.cpus_per_rank)
    print_table(per_rank[0])
    if args.profile:
        print_profiles(per_rank)


if __name__ == "__main__":
    main()
