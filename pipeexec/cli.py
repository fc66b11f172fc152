"""``pipeexec train ...``: run a schedule for real.

Under torchrun (RANK/WORLD_SIZE set) every process trains as its rank. Otherwise the command
forks ``--nproc`` local workers itself (default pp * dp). ``--pp 1 --dp 1`` is plain
single-process training of the same model: the reference. This is the only place that exits
the process with a status; the library raises exceptions.
"""
from __future__ import annotations

import argparse
import os
import sys

from .checkpoint.cli import add_commands, add_train_flags, options_from_args, run_command
from .config import ConfigError, TrainConfig
from .profile.cli import add_compare_command, add_profile_flags, profile_from_args


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pipeexec", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train the built-in GPT with a pipeline schedule")
    d = TrainConfig()
    a = t.add_argument
    a("--schedule", default=d.schedule, help="a pipesim schedule name (pipesim list), or a "
      "schedule file: FILE.json (pipesim) or FILE.csv (torch's, compute-only or with comms)")
    a("--memory-limit", type=_bytes, default=None, metavar="BYTES",
      help="with --schedule zb-auto: profile --reschedule-after steps of ZB-H1, search zb-auto "
           "from the measured costs under this per-rank limit (e.g. 2GB), switch to it")
    a("--reschedule-after", type=int, default=d.reschedule_after, metavar="K")
    a("--pp", type=int, default=d.pp, help="pipeline ranks")
    a("--vpp", type=int, default=d.vpp, help="stages (chunks) per pipeline rank")
    a("--dp", type=int, default=d.dp, help="data-parallel replicas")
    a("--microbatches", type=int, default=d.microbatches, help="microbatches per replica per step")
    a("--micro-batch-size", type=int, default=d.micro_batch_size)
    a("--layers", type=int, default=d.layers, help="transformer blocks (plus embedding and head)")
    a("--hidden", type=int, default=d.hidden)
    a("--heads", type=int, default=d.heads)
    a("--seq-len", type=int, default=d.seq_len)
    a("--vocab", type=int, default=d.vocab)
    a("--partition", choices=("layers", "params"), default=d.partition)
    a("--boundaries", default=None,
      help="explicit stage boundaries: first layer index of stages 1..S-1, comma separated")
    a("--data", default=d.data, help="'synthetic' or a text file (byte-level tokens)")
    a("--steps", type=int, default=d.steps, help="optimizer iterations in total")
    a("--lr", type=float, default=d.lr)
    a("--min-lr", type=float, default=d.min_lr)
    a("--warmup-steps", type=int, default=d.warmup_steps)
    a("--decay-steps", type=int, default=d.decay_steps,
      help="cosine decay length in iterations (default: --steps); fix it to stop a run early "
           "and resume it on the same LR curve")
    a("--weight-decay", type=float, default=d.weight_decay)
    a("--clip-grad", type=float, default=d.clip_grad, help="global-norm clip (0: off)")
    a("--precision", choices=("fp32", "bf16", "fp16"), default=d.precision)
    a("--loss-scale", type=float, default=d.loss_scale, help="initial dynamic loss scale (fp16)")
    a("--loss-scale-growth-interval", type=int, default=d.loss_scale_growth_interval)
    a("--seed", type=int, default=d.seed)
    a("--p2p-timeout", type=float, default=d.p2p_timeout, help="seconds per send/receive")
    a("--recv-lookahead", type=int, default=d.recv_lookahead,
      help="post each receive this many computations before the one that needs it (0: right "
           "before it); the simulator models the same schedule")
    a("--cpu-return-freed-memory", action="store_true",
      help="CPU: let malloc give freed memory back to the kernel (by default it is kept for "
           "the next step, which saves a page fault per fresh page; pipeexec/malloc.py)")
    a("--backend", default=None, help="nccl or gloo (default: nccl with CUDA, else gloo)")
    a("--device", default=None, help="cpu or cuda (default: cuda when available)")
    a("--nproc", type=int, default=None, help="local workers to start (default pp * dp)")
    a("--timeout", type=float, default=None, help="overall limit for a local run, seconds")
    a("--cpus-per-rank", type=float, default=None, metavar="X",
      help="local run on CPU: confine each rank to X CPUs with a cgroup quota (e.g. 0.5 for 4 "
           "ranks on 2 cores), so ranks do not slow each other down as they would sharing "
           "cores; needs write access to the cgroup CPU controller")
    a("--inject", action="append", default=[], help=argparse.SUPPRESS)
    a("--metrics-out", default=None, help="write losses and step times as JSON here")
    a("--no-progress", action="store_true", help="no progress bar")
    a("--forward-only", action="store_true",
      help="evaluate: run the schedule's forward-only variant, no backward, no optimizer step")
    add_train_flags(t)
    add_profile_flags(t)
    add_commands(sub)
    add_compare_command(sub)
    return p


def _bytes(text: str) -> float:
    from pipesim.cli.simulate_cmds import parse_bytes

    return parse_bytes(text)


def config_from_args(ns: argparse.Namespace) -> TrainConfig:
    boundaries = None
    if ns.boundaries:
        try:
            boundaries = tuple(int(x) for x in ns.boundaries.split(","))
        except ValueError:
            raise ConfigError(f"--boundaries must be comma-separated integers, got {ns.boundaries!r}") from None
    return TrainConfig(
        schedule=ns.schedule, memory_limit=ns.memory_limit, reschedule_after=ns.reschedule_after,
        pp=ns.pp, vpp=ns.vpp, dp=ns.dp, microbatches=ns.microbatches,
        micro_batch_size=ns.micro_batch_size, layers=ns.layers, hidden=ns.hidden, heads=ns.heads,
        seq_len=ns.seq_len, vocab=ns.vocab, partition=ns.partition, boundaries=boundaries,
        data=ns.data, steps=ns.steps, lr=ns.lr, min_lr=ns.min_lr, warmup_steps=ns.warmup_steps,
        decay_steps=ns.decay_steps,
        weight_decay=ns.weight_decay, clip_grad=ns.clip_grad, precision=ns.precision,
        loss_scale=ns.loss_scale, loss_scale_growth_interval=ns.loss_scale_growth_interval,
        seed=ns.seed, p2p_timeout=ns.p2p_timeout, recv_lookahead=ns.recv_lookahead,
        cpu_keep_freed_memory=not ns.cpu_return_freed_memory,
        backend=ns.backend, device=ns.device,
        inject=tuple(ns.inject), forward_only=ns.forward_only)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["compare"]:
        from .profile.compare_cli import compare_main
        sys.exit(compare_main(args[1:], _parser, config_from_args))
    ns = _parser().parse_args(args)
    if ns.command == "checkpoint":
        sys.exit(run_command(ns))
    import pipesim
    from .checkpoint import CheckpointError, read_tracker
    from .cpu_quota import QuotaUnavailable
    from .launcher import WorkerFailed, launch
    from .worker import run_training

    try:
        config = config_from_args(ns)
        under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
        world = int(os.environ["WORLD_SIZE"]) if under_torchrun else (ns.nproc or config.world_size)
        config.validate(world_size=world)    # before any process group exists
        checkpoint = options_from_args(ns)
        if checkpoint.load is not None:
            read_tracker(checkpoint.load)       # a bad --load fails before any worker starts
        profile = profile_from_args(ns)
        if under_torchrun and ns.cpus_per_rank is not None:
            raise ConfigError("--cpus-per-rank confines the workers of a local run; under "
                              "torchrun, set CPU limits where the processes are started")
        if under_torchrun:
            run_training(None, config, ns.metrics_out, progress=not ns.no_progress,
                         checkpoint=checkpoint, profile=profile)
        else:
            launch(run_training, world,
                   (config, ns.metrics_out, not ns.no_progress, checkpoint, profile),
                   timeout=ns.timeout, cpus_per_rank=ns.cpus_per_rank)
    except (ConfigError, pipesim.ScheduleError, ValueError, QuotaUnavailable) as exc:
        print(f"pipeexec: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except (WorkerFailed, CheckpointError) as exc:
        print(f"pipeexec: error: {exc}", file=sys.stderr)
        sys.exit(1)
    except RuntimeError as exc:   # under torchrun: PipelineError, P2PError, TopologyError ...
        print(f"pipeexec: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
