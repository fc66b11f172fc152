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

from pipesim.cli.help import DefaultsHelpFormatter

from .checkpoint import add_train_flags, options_from_args
from ..config import SECTIONS, ConfigError, TrainConfig
from ..options import add_arguments, values_from_args
from .profile_flags import add_profile_flags, profile_from_args



def add_config_arguments(t: argparse.ArgumentParser) -> None:
    """One flag per `TrainConfig` field that has one, generated from the field's metadata
    (help, type, choices...), its default the field's (`pipeexec.options`)."""
    d = TrainConfig()
    for name, cls in SECTIONS.items():
        add_arguments(t, cls, getattr(d, name))


def add_train_arguments(t: argparse.ArgumentParser) -> None:
    """Every flag of ``pipeexec train`` (``compare`` reuses them all)."""
    a = t.add_argument
    a("--plan", default=None, metavar="PLAN.json",
      help="run this pipesim plan (Plan.to_json, pipesim simulate --save-plan): its schedule, "
           "layout, batch, model and precision (the flags below that set those are then "
           "refused); what pipeexec cannot run (tp, cp, ep > 1, ZeRO...) is "
           "refused with the reason before any worker starts")
    add_config_arguments(t)
    a("--nproc", type=int, default=None, help="local workers to start (default pp * dp)")
    a("--timeout", type=float, default=None,
      help="overall limit for a local run, seconds (default: none)")
    a("--cpus-per-rank", type=float, default=None, metavar="X",
      help="local run on CPU: confine each rank to X CPUs with a cgroup quota (e.g. 0.5 for 4 "
           "ranks on 2 cores), so ranks do not slow each other down as they would sharing "
           "cores; needs write access to the cgroup CPU controller (default: not confined)")
    a("--metrics-out", default=None, help="write losses and step times as JSON here")
    a("--no-progress", action="store_true", help="no progress bar")
    add_train_flags(t)
    add_profile_flags(t)


TRAIN_HELP = "train the built-in GPT (or a Hugging Face model) with a pipeline schedule"


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


def config_from_args(ns: argparse.Namespace) -> TrainConfig:
    """The `TrainConfig` the generated flags (`add_config_arguments`) spell."""
    return TrainConfig(**{k: v for cls in SECTIONS.values()
                          for k, v in values_from_args(cls, ns).items()})


# train flags a plan file sets (pipeexec.plan_config)
PLAN_DESTS = ("schedule", "pp", "vpp", "dp", "microbatches", "micro_batch_size", "layers",
              "hidden", "heads", "seq_len", "vocab", "ffn_mult", "precision", "partition",
              "boundaries", "recompute", "recompute_layers")


def apply_plan(ns: argparse.Namespace, config: TrainConfig, given: set[str]) -> TrainConfig:
    """``config`` with ``--plan``'s fields (unchanged without ``--plan``). Raises ConfigError
    naming a flag the plan also sets, or what of the plan pipeexec cannot run."""
    if not getattr(ns, "plan", None):
        return config
    import pipesim

    from ..plan_config import config_from_plan

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
        return config_from_plan(plan, config, source=str(ns.plan))
    except ConfigError as exc:
        raise ConfigError(f"--plan {ns.plan}: {exc}") from None


def apply_hf_model(config: TrainConfig, given: set[str]) -> TrainConfig:
    """``config`` with its ``--hf-model`` directory's shape (unchanged without one). Raises
    ConfigError naming a model flag given next to it, or what is wrong with the directory."""
    if not config.hf_model:
        return config
    from ..models.hf_config import HF_FIELDS

    clash = [d for d in HF_FIELDS if d in given]
    if clash:
        raise ConfigError(f"--hf-model {config.hf_model} takes the model's shape from its "
                          f"config.json; drop {', '.join('--' + d.replace('_', '-') for d in clash)}"
                          " (or edit config.json)")
    return config.with_hf_model(config.hf_model)


def train_main(args: list[str]) -> None:
    """``pipeexec train ARGS``: check everything, then train in local workers (or as this
    process's rank under torchrun); exits with 0, 1 (a run failed), 2 (bad input) or 130."""
    ns = train_parser().parse_args(args)
    import pipesim
    from ..checkpoint import CheckpointError, read_tracker
    from ..launching.cpu_quota import QuotaUnavailable
    from ..launching.devices import cuda_device_count, may_use_cuda, start_method_for
    from ..launching.launcher import WorkerFailed, launch
    from ..launching.preflight import check_train
    from ..launching.worker import run_training

    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun else (ns.nproc or ns.pp * ns.dp)
    try:
        config = config_from_args(ns)
        if config.hf_model:          # before the plan, which is checked against the model
            config = apply_hf_model(config, explicit_dests(train_parser(), args))
        if ns.plan:
            config = apply_plan(ns, config, explicit_dests(train_parser(), args))
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

