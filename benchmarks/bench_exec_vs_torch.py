"""pipeexec vs torch.distributed.pipelining, side by side in one run (CPU / gloo).

Same model (the built-in GPT's layers, cut at the same stage boundaries), same ranks,
microbatches, data and loss, for GPipe, 1F1B, Interleaved1F1B and ZBV. Each timed step is one
pipeline forward + backward over the global batch (gradients accumulated, no optimizer), the two
executors alternating step by step so that background load hits both alike. Step time: the
slowest rank's time from a common barrier to its last action; the median over the timed steps.

The paired ratio is the median over timed steps of (pipeexec step / torch step) of the same
round, with its quartiles: the noise of the machine shows there.

Idle share: ``1 - compute / step_time``, where ``compute`` is the slowest rank's time to run its
own stages' forward and backward over all microbatches with no pipeline (no communication, no
waiting), every rank doing so at the same moment, so ranks sharing cores compete as they do in
the pipeline steps. The same figure for both executors: a comparison of their idle time, not the
Zero Bubble paper's ``bubble_rate`` (which takes each rank's busy time inside its own pipelined
step).

Losses: every timed and warm-up step's microbatch losses of the two executors agree (rtol 1e-5),
on every rank holding the last stage.

    OMP_NUM_THREADS=1 python benchmarks/bench_exec_vs_torch.py            # pp 2, 2 CPU ranks
    OMP_NUM_THREADS=1 python benchmarks/bench_exec_vs_torch.py --pp 4 --steps 6

Target: pipeexec's step time at or below torch's (ratio <= 1.0), idle share no larger.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

from pipeexec import launch
from pipeexec.data import BatchSource
from pipeexec.training.ddp import GradBuffer
from pipeexec.config import GPT_MODEL
from pipeexec.model import gpt_stack
from pipeexec.pipeline.p2p import P2P
from pipeexec.partition import by_layers
from pipeexec.pipeline.runtime import PipelineRuntime
from pipeexec.pipeline.stage import build_stage
from pipeexec.topology import destroy_topology, init_topology

# pipeexec schedule name, vpp, torch schedule class name
SCHEDULES = [("gpipe", 1, "ScheduleGPipe"), ("1f1b", 1, "Schedule1F1B"),
             ("interleaved", 2, "ScheduleInterleaved1F1B"), ("zbv", 2, "ScheduleZBVZeroBubble")]


def _barrier_time(t0: float) -> float:
    """Slowest rank's elapsed time since its t0 (all ranks started after a barrier)."""
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return dt.item()


def pipeexec_runner(schedule, topo, mine: dict, loss_fn, src: BatchSource, microbatches: int,
                    device: torch.device):
    """One pipeexec step over ``mine`` (this rank's stages): its microbatch losses. Gradients
    accumulate into a flat fp32 buffer (each ``.grad`` a view of it), as in training."""
    buf = GradBuffer({s: list(st.parameters()) for s, st in mine.items()}, device)
    buf.bind()
    p2p = P2P(rank=topo.rank, pp_rank=topo.pp_rank, groups=topo.p2p_groups, peers=topo.pp_ranks,
              num_stages=schedule.num_stages, num_microbatches=microbatches, device=device,
              timeout=300)
    rt = PipelineRuntime(schedule, topo.pp_rank, mine, loss_fn, buf.accumulate, p2p,
                         global_rank=topo.rank, device=device, grads_in_place=True)

    def run(step):
        buf.zero()
        out = rt.run(src.microbatches(step, 0, 1, microbatches), step=step)
        return [v.item() for _, v in sorted(out.losses.items())]
    return run


def _scalar(v) -> float:
    """A loss as a float (a DTensor loss: its local value, the same on every rank of its mesh)."""
    return (v.to_local() if hasattr(v, "to_local") else v).item()


def torch_runner(tsched, theirs: dict, src: BatchSource, first: bool, last: bool):
    """One torch.distributed.pipelining step of ``tsched`` over ``theirs``: its losses."""
    def run(step):
        for st in theirs.values():
            st.zero_grad(set_to_none=True)
        x, y = src.global_batch_at(step)
        losses: list = []
        kwargs = {}
        if last:
            kwargs.update(target=y, losses=losses)
        if first:
            tsched.step(x, **kwargs)
        else:
            tsched.step(**kwargs)
        return [_scalar(v) for v in losses]
    return run


def busy_runner(mine: dict, loss_fn, src: BatchSource, microbatches: int, hidden: int,
                num_stages: int):
    """This rank's compute alone: its stages' F and B over all microbatches (no pipeline)."""
    def run(step):
        for x, y in src.microbatches(step, 0, 1, microbatches):
            for s in sorted(mine):
                inp = x if s == 0 else torch.randn(x.shape + (hidden,), requires_grad=True)
                h = mine[s](inp)
                if s == num_stages - 1:
                    h = loss_fn(h, y)
                torch.autograd.backward(h, torch.ones_like(h) if h.dim() else None)
        return []
    return run


def time_rounds(runs: tuple, warmup: int, steps: int) -> tuple[dict, dict]:
    """Rounds of ``runs`` ((name, fn) pairs; fn(step) returns its losses), so that load from
    other processes on the machine hits all alike; the first two swap places every other
    round (no order bias). Returns each name's timed step times and every step's losses."""
    times: dict[str, list] = {who: [] for who, _ in runs}
    losses: dict[str, list] = {who: [] for who, _ in runs}
    for step in range(warmup + steps):
        order = runs if step % 2 == 0 else (runs[1], runs[0], *runs[2:])
        for who, fn in order:
            dist.barrier()
            t0 = time.perf_counter()
            out = fn(step)
            dt = _barrier_time(t0)
            if step >= warmup:
                times[who].append(dt)
            losses[who].append(out)
    return times, losses


def losses_agree(a_steps: list, b_steps: list, rtol: float = 1e-5) -> tuple[bool, int]:
    """Whether every step's microbatch losses agree on every rank (rtol); steps compared."""
    def agree(a: list, b: list) -> bool:
        return len(a) == len(b) and all(abs(u - v) <= rtol * abs(v) for u, v in zip(a, b))
    steps_agree = [agree(a, b) for a, b in zip(a_steps, b_steps)]
    same = torch.tensor([float(all(steps_agree))])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same.item()), len(steps_agree)


def summary_row(name: str, vpp: int, torch_name: str, times: dict, losses: dict) -> dict:
    same, compared = losses_agree(losses["pipeexec"], losses["torch"])
    return {"schedule": name, "vpp": vpp, "torch": torch_name,
            "pipeexec_s": statistics.median(times["pipeexec"]),
            "torch_s": statistics.median(times["torch"]),
            "busy_s": statistics.median(times["busy"]),
            "pairs": [a / b for a, b in zip(times["pipeexec"], times["torch"])],
            "same_losses": same, "steps_compared": compared}


def worker(board, args) -> list[dict]:
    import pipesim
    import torch.distributed.pipelining as tpp

    topo = init_topology(args.pp, 1, timeout=300)
    spec = gpt_stack(GPT_MODEL.with_(layers=args.layers, hidden=args.hidden, heads=args.heads,
                                     seq_length=args.seq_len, vocab=args.vocab))
    src = BatchSource(seed=0, seq_len=args.seq_len, vocab=args.vocab,
                      global_batch=args.microbatches * args.micro_batch_size)
    cpu = torch.device("cpu")
    rows = []
    try:
        for name, vpp, torch_name in SCHEDULES:
            if args.schedules and name not in args.schedules.split(","):
                continue
            schedule = pipesim.build_schedule(name, pp=args.pp, microbatches=args.microbatches,
                                              vpp=vpp, recv_lookahead=args.recv_lookahead
                                              ).validate()
            bounds = by_layers(spec.num_layers, schedule.num_stages)
            mine = {s: build_stage(spec, s, bounds, seed=0, device=cpu, dtype=torch.float32)
                    for s in schedule.rank_stages(topo.pp_rank)}
            theirs = {s: build_stage(spec, s, bounds, seed=0, device=cpu, dtype=torch.float32)
                      for s in mine}
            # torch.distributed.pipelining, same stages on the same ranks
            stages = [tpp.PipelineStage(theirs[s], s, schedule.num_stages, cpu, group=topo.pp_group)
                      for s in sorted(theirs)]
            cls = getattr(tpp, torch_name)
            tsched = cls(stages[0] if vpp == 1 else stages, n_microbatches=args.microbatches,
                         loss_fn=spec.loss_fn)
            runs = (("pipeexec", pipeexec_runner(schedule, topo, mine, spec.loss_fn, src,
                                                 args.microbatches, cpu)),
                    ("torch", torch_runner(tsched, theirs, src, 0 in theirs,
                                           schedule.num_stages - 1 in theirs)),
                    ("busy", busy_runner(mine, spec.loss_fn, src, args.microbatches, args.hidden,
                                         schedule.num_stages)))
            times, losses = time_rounds(runs, args.warmup, args.steps)
            rows.append(summary_row(name, vpp, torch_name, times, losses))
            del tsched, stages
    finally:
        destroy_topology(topo)
    return rows


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    """First quartile, median, third quartile (the spread of the step-by-step ratios)."""
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The flags this benchmark shares with bench_exec_vs_torch_tp.py."""
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--micro-batch-size", type=int, default=2)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--recv-lookahead", type=int, default=1,
                   help="pipeexec posts each receive this many computations before its consumer")
    p.add_argument("--warmup", type=int, default=2)


def print_table(rows: list[dict]) -> None:
    print(f"{'schedule':<12} {'torch class':<26} {'pipeexec s':>10} {'torch s':>9} {'ratio':>6} "
          f"{'paired ratio [q1, q3]':>22} {'idle share pipeexec':>19} {'torch':>6}  "
          "same losses (every step)")
    for r in rows:
        bp = 1 - r["busy_s"] / r["pipeexec_s"]
        bt = 1 - r["busy_s"] / r["torch_s"]
        q1, med, q3 = _quartiles(r["pairs"])
        print(f"{r['schedule']:<12} {r['torch']:<26} {r['pipeexec_s']:>10.3f} {r['torch_s']:>9.3f} "
              f"{r['pipeexec_s'] / r['torch_s']:>6.2f} {f'{med:.3f} [{q1:.2f}, {q3:.2f}]':>22} "
              f"{bp:>19.1%} {bt:>6.1%}  {r['same_losses']} ({r['steps_compared']} steps)")
    sys.stdout.flush()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, default=2)
    add_model_args(p)
    p.add_argument("--schedules", default="", help="comma-separated subset of "
                   + ",".join(n for n, _, _ in SCHEDULES))
    args = p.parse_args(argv)
    print(f"pp={args.pp} m={args.microbatches} b={args.micro_batch_size} GPT layers={args.layers}+2 "
          f"hidden={args.hidden} seq={args.seq_len}; CPU/gloo, {torch.__version__}; median of "
          f"{args.steps} steps (fwd+bwd, no optimizer)", flush=True)
    rows = launch(worker, args.pp, (args,), timeout=3000)[0]
    print_table(rows)


if __name__ == "__main__":
    main()
