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

from pipesim.cli.help import DefaultsHelpFormatter, VersionAction, package_version

from .checkpoint.cli import add_commands, add_train_flags, options_from_args, run_command
from .config import ConfigError, TrainConfig
from .profile.cli import add_compare_command, add_profile_flags, profile_from_args


DESCRIPTION = ("Run pipesim schedules for real over torch.distributed (gloo on CPU, NCCL on "
               "GPUs): train, checkpoint, and compare predicted with measured.")


def add_train_arguments(t: argparse.ArgumentParser) -> None:
    """Every flag of ``pipeexec train`` (``compare`` reuses them all)."""
    d = TrainConfig()
    a = t.add_argument
    a("--schedule", default=d.schedule, help="a pipesim schedule name (pipesim list), or a "
      "schedule file: FILE.json (pipesim) or FILE.csv (torch's, compute-only or with comms)")
    a("--memory-limit", type=_bytes, default=None, metavar="BYTES",
      help="with --schedule zb-auto: profile --reschedule-after steps of ZB-H1, search zb-auto "
           "from the measured costs under this per-rank limit (e.g. 2GB), switch to it")
    a("--reschedule-after", type=int, default=d.reschedule_after, metavar="K",
      help="with --memory-limit: profiled steps of ZB-H1 before zb-auto takes over")
    a("--plan", default=None, metavar="PLAN.json",
      help="run this pipesim plan (Plan.to_json, pipesim simulate --save-plan): its schedule, "
           "layout, batch, model and precision (the flags below that set those are then "
           "refused); what pipeexec cannot run (tp, cp, ep > 1, ZeRO, recomputation...) is "
           "refused with the reason before any worker starts")
    a("--pp", type=int, default=d.pp, help="pipeline ranks")
    a("--vpp", type=int, default=d.vpp, help="stages (chunks) per pipeline rank")
    a("--dp", type=int, default=d.dp, help="data-parallel replicas")
    a("--microbatches", type=int, default=d.microbatches, help="microbatches per replica per step")
    a("--micro-batch-size", type=int, default=d.micro_batch_size,
      help="sequences per microbatch")
    a("--layers", type=int, default=d.layers, help="transformer blocks (plus embedding and head)")
    a("--hidden", type=int, default=d.hidden, help="model width (divisible by --heads)")
    a("--heads", type=int, default=d.heads, help="attention heads")
    a("--seq-len", type=int, default=d.seq_len, help="tokens per sequence")
    a("--vocab", type=int, default=d.vocab, help="vocabulary size (>= 256 for a text file)")
    a("--partition", choices=("layers", "params"), default=d.partition,
      help="cut the layers into stages of equal layer counts or of balanced parameter counts")
    a("--boundaries", default=None,
      help="explicit stage boundaries: first layer index of stages 1..S-1, comma separated")
    a("--data", default=d.data, help="'synthetic' or a text file (byte-level tokens)")
    a("--steps", type=int, default=d.steps, help="optimizer iterations in total")
    a("--lr", type=float, default=d.lr, help="peak learning rate (AdamW)")
    a("--min-lr", type=float, default=d.min_lr, help="learning rate at the end of the decay")
    a("--warmup-steps", type=int, default=d.warmup_steps, help="linear LR warm-up iterations")
    a("--decay-steps", type=int, default=d.decay_steps,
      help="cosine decay length in iterations (default: --steps); fix it to stop a run early "
           "and resume it on the same LR curve")
    a("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay")
    a("--clip-grad", type=float, default=d.clip_grad, help="global-norm clip (0: off)")
    a("--precision", choices=("fp32", "bf16", "fp16"), default=d.precision,
      help="compute precision (bf16 / fp16 keep fp32 master weights)")
    a("--loss-scale", type=float, default=d.loss_scale, help="initial dynamic loss scale (fp16)")
    a("--loss-scale-growth-interval", type=int, default=d.loss_scale_growth_interval,
      help="fp16: double the loss scale after this many steps without overflow")
    a("--seed", type=int, default=d.seed, help="seed of the weights, data and dropout")
    a("--p2p-timeout", type=float, default=d.p2p_timeout, help="seconds per send/receive")
    a("--recv-lookahead", type=int, default=d.recv_lookahead,
      help="post each receive this many computations before the one that needs it (0: right "
           "before it); the simulator models the same schedule")
    a("--nccl-matching", action="store_true",
      help="gloo on CPU matching point-to-point transfers as NCCL does (tags ignored, in "
           "posting order per group and pair of ranks): shows on CPU what a NCCL run would get")
    a("--cpu-return-freed-memory", action="store_true",
      help="CPU: let malloc give freed memory back to the kernel (by default it is kept for "
           "the next step, which saves a page fault per fresh page; pipeexec/malloc.py)")
    a("--backend", default=None, help="nccl or gloo (default: nccl with CUDA, else gloo)")
    a("--device", default=None, help="cpu or cuda (default: cuda when available)")
    a("--nproc", type=int, default=None, help="local workers to start (default pp * dp)")
    a("--timeout", type=float, default=None,
      help="overall limit for a local run, seconds (default: none)")
    a("--cpus-per-rank", type=float, default=None, metavar="X",
      help="local run on CPU: confine each rank to X CPUs with a cgroup quota (e.g. 0.5 for 4 "
           "ranks on 2 cores), so ranks do not slow each other down as they would sharing "
           "cores; needs write access to the cgroup CPU controller (default: not confined)")
    a("--inject", action="append", default=[], help=argparse.SUPPRESS)
    a("--metrics-out", default=None, help="write losses and step times as JSON here")
    a("--no-progress", action="store_true", help="no progress bar")
    a("--forward-only", action="store_true",
      help="evaluate: run the schedule's forward-only variant, no backward, no optimizer step")
    add_train_flags(t)
    add_profile_flags(t)


TRAIN_HELP = "train the built-in GPT with a pipeline schedule"


def train_parser(prog: str = "pipeexec train") -> argparse.ArgumentParser:
    """``pipeexec train``'s own parser: its usage and errors name train's flags."""
    t = argparse.ArgumentParser(prog=prog, description=TRAIN_HELP,
                                formatter_class=DefaultsHelpFormatter)
    add_train_arguments(t)
    return t


def explicit_dests(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """The destinations of the flags ``argv`` sets (abbreviated or ``--flag=value`` forms
    included), as opposed to those left at their defaults."""
    unset = object()
    dests = [k for k, v in vars(parser.parse_args([])).items() if not isinstance(v, list)]
    ns = parser.parse_args(argv, namespace=argparse.Namespace(**{k: unset for k in dests}))
    return {k for k in dests if getattr(ns, k) is not unset}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pipeexec", description=DESCRIPTION,
                                formatter_class=DefaultsHelpFormatter)
    p.add_argument("--version", action=VersionAction, version_text=_version)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help=TRAIN_HELP, description=TRAIN_HELP,
                       formatter_class=DefaultsHelpFormatter)
    add_train_arguments(t)
    add_commands(sub)
    add_compare_command(sub)
    return p


def _version() -> str:
    import torch

    return f"pipeexec {package_version()} (torch {torch.__version__})"


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
        nccl_matching=ns.nccl_matching,
        cpu_keep_freed_memory=not ns.cpu_return_freed_memory,
        backend=ns.backend, device=ns.device,
        inject=tuple(ns.inject), forward_only=ns.forward_only)


# train flags a plan file sets (pipeexec.plan_config)
PLAN_DESTS = ("schedule", "pp", "vpp", "dp", "microbatches", "micro_batch_size", "layers",
              "hidden", "heads", "seq_len", "vocab", "precision", "partition", "boundaries")


def apply_plan(ns: argparse.Namespace, config: TrainConfig, given: set[str]) -> TrainConfig:
    """``config`` with ``--plan``'s fields (unchanged without ``--plan``). Raises ConfigError
    naming a flag the plan also sets, or what of the plan pipeexec cannot run."""
    if not getattr(ns, "plan", None):
        return config
    import pipesim

    from .plan_config import config_from_plan

    clash = [d for d in PLAN_DESTS if d in given]
    if clash:
        raise ConfigError(f"--plan {ns.plan} sets the layout, batch, model and precision; "
                          f"drop {', '.join('--' + d.replace('_', '-') for d in clash)} (or edit "
                          "the plan)")
    try:
        plan = pipesim.Plan.from_json(ns.plan)
    except pipesim.PlanError as exc:
        raise ConfigError(f"--plan: {exc}") from None
    try:
        return config_from_plan(plan, config)
    except ConfigError as exc:
        raise ConfigError(f"--plan {ns.plan}: {exc}") from None


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["compare"]:
        from .profile.compare_cli import compare_main
        sys.exit(compare_main(args[1:]))
    if args[:1] == ["train"]:      # errors and usage of train's own parser
        ns = train_parser().parse_args(args[1:])
        ns.command = "train"
    else:
        ns = _parser().parse_args(args)
    if ns.command == "checkpoint":
        sys.exit(run_command(ns))
    import pipesim
    from .checkpoint import CheckpointError, read_tracker
    from .cpu_quota import QuotaUnavailable
    from .devices import cuda_device_count, may_use_cuda, start_method_for
    from .launcher import WorkerFailed, launch
    from .preflight import check_train
    from .worker import run_training

    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun else (ns.nproc or ns.pp * ns.dp)
    try:
        config = config_from_args(ns)
        if ns.plan:
            config = apply_plan(ns, config, explicit_dests(train_parser(), args[1:]))
            if not under_torchrun:
                world = ns.nproc or config.world_size
        config.validate(world_size=world)    # before any process group exists
        checkpoint = options_from_args(ns)
        if checkpoint.load is not None:
            read_tracker(checkpoint.load)       # a bad --load fails before any worker starts
        profile = profile_from_args(ns)
        if under_torchrun and ns.cpus_per_rank is not None:
            raise ConfigError("--cpus-per-rank confines the workers of a local run; under "
                              "torchrun, set CPU limits where the processes are started")
        if (config.device or "").startswith("cuda") and cuda_device_count() == 0:
            raise ConfigError(f"--device {config.device}: no CUDA device is visible here (NVML "
                              "counts none; check the driver and CUDA_VISIBLE_DEVICES), or use "
                              "--device cpu")
        if ns.cpus_per_rank is not None and may_use_cuda(config.device, config.backend):
            raise ConfigError("--cpus-per-rank is for CPU runs: on CUDA it would throttle the "
                              "threads that launch kernels and drive NCCL (drop it, or use "
                              "--device cpu)")
        checks = check_train(config, checkpoint, nproc=world, cpus_per_rank=ns.cpus_per_rank)
        first = not under_torchrun or os.environ.get("RANK") == "0"
        for warning in checks.warnings if first else ():
            print(f"pipeexec: warning: {warning}", file=sys.stderr, flush=True)
        if checks.nothing_to_train:
            if first:
                print(f"pipeexec: {checks.nothing_to_train}", flush=True)
            sys.exit(0)
        if under_torchrun:
            run_training(None, config, ns.metrics_out, progress=not ns.no_progress,
                         checkpoint=checkpoint, profile=profile)
        else:
            launch(run_training, world,
                   (config, ns.metrics_out, not ns.no_progress, checkpoint, profile),
                   timeout=ns.timeout, cpus_per_rank=ns.cpus_per_rank,
                   start_method=start_method_for(config.device, config.backend))
    except KeyboardInterrupt:
        # The launcher's cleanup has run (every worker stopped, quotas removed) on the way here.
        stopped = "" if under_torchrun else f": stopped {world} worker{'s' if world != 1 else ''}"
        print(f"\npipeexec: interrupted{stopped}", file=sys.stderr, flush=True)
        sys.exit(130)
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
