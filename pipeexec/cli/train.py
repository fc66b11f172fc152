"""``pipeexec train ...``: run a schedule for real.

Under torchrun (RANK/WORLD_SIZE set) every process trains as its rank. Otherwise the command
forks ``--nproc`` local workers itself (default tp * cp * pp * dp). ``--pp 1 --dp 1`` is plain
single-process training of the same model: the reference. This is the only place that exits
the process with a status; the library raises exceptions.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import pipesim
from pipesim.cli.help import DefaultsHelpFormatter
from pipesim.errors import PlanError
from pipesim.plan.flags import BY_DEST, DESTS, add_plan_flags, apply_flags
from pipesim.schedule.placement import PLACEMENTS

from .checkpoint import add_train_flags, options_from_args
from .given import GivenFlagsParser
from ..config import DEFAULT_PLAN, PLAN_VIEWS, SECTIONS, ConfigError, TrainConfig, plan_view
from ..models.hf_config import HF_FIELDS
from ..flag_fields import add_arguments, values_from_args
from ..run.prepare import PreparedRun, prepare
from .monitor_flags import add_monitor_flags, evaluation_from_args, logging_from_args
from .profile_flags import add_profile_flags, profile_from_args

# train's own plan flags (not in pipesim's table: pipesim simulate names its schedule as an
# argument): the schedule and zb-auto's placement, fields of the plan as well
_SCHEDULE_FLAGS = ("schedule", "placement")
# the destinations of every flag that sets a plan field
PLAN_DESTS = DESTS + _SCHEDULE_FLAGS
_MODEL_DESTS = tuple(d for d in DESTS if BY_DEST[d].group == "model")


def _shown_defaults() -> dict[str, Any]:
    """dest -> `DEFAULT_PLAN`'s value of each plan flag (None: no default): the flag's default,
    shown in ``--help``; a flag left out is not applied (`GivenFlagsParser`), so a plan file's
    value stands."""

    out: dict[str, Any] = {}
    for dest in DESTS:
        value = plan_view(DEFAULT_PLAN, dest) if dest in PLAN_VIEWS else None
        if isinstance(value, bool) or value is None:
            continue
        out[dest] = value
    return out


def add_config_arguments(t: argparse.ArgumentParser) -> None:
    """The plan's flags (`pipesim.plan.flags`: layout, batch, model shape, one table for
    every command; not given: the base plan's value) and one flag per executor field that has
    one, generated from the field's metadata, its default the field's (`pipeexec.flag_fields`)."""

    a = t.add_argument
    a("--schedule", default=None,
      help="a pipesim schedule name (pipesim list), or a schedule file: FILE.json (pipesim) or "
           "FILE.csv (torch's, compute-only or with comms) (default: the plan's; without --plan "
           f"{DEFAULT_PLAN.schedule})")
    a("--placement", default=None, choices=PLACEMENTS,
      help="with --schedule zb-auto --vpp 2: where its stages sit, looped (Megatron's "
           "interleaved) or v (ZB-V's); default: both searched, or v with --memory-limit (the "
           "profiled ZB-V's placement)")
    add_plan_flags(t, defaults=_shown_defaults())
    d = TrainConfig()
    for name, cls in SECTIONS.items():
        add_arguments(t, cls, getattr(d, name))


def add_train_arguments(t: argparse.ArgumentParser, *, monitor: bool = True) -> None:
    """Every flag of ``pipeexec train`` (``compare`` reuses them all but validation and
    metrics logging: ``monitor=False``)."""
    a = t.add_argument
    a("--plan", default=None, metavar="PLAN.json",
      help="run this pipesim plan (pipesim simulate --save-plan, pipesim plan --plan-out): its "
           "schedule, layout, batch, model and precision; a layout, batch or model flag given "
           "as well overrides that field of the plan (the rule of every command). Without "
           "--plan the base is the built-in GPT's tiny default (2 layers, hidden 64, 4 heads, "
           "seq-len 32, vocab 256) at pp 1, dp 1, one microbatch, fp32, 1f1b. What pipeexec "
           "cannot run (fp8, ep on a dense model or not dividing dp * cp, a layout that does "
           "not cut...) is refused with the reasons before any worker starts")
    add_config_arguments(t)
    a("--nproc", type=int, default=None, help="local workers to start (default tp * cp * pp * dp)")
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
    if monitor:
        add_monitor_flags(t)


TRAIN_HELP = "train the built-in GPT (or a Hugging Face model) with a pipeline schedule"


def train_parser(prog: str = "pipeexec train", *, monitor: bool = True
                 ) -> argparse.ArgumentParser:
    """``pipeexec train``'s own parser: its usage and errors name train's flags (``monitor``:
    with the validation and logging flags, which ``compare`` has not)."""
    t = GivenFlagsParser(prog=prog, description=TRAIN_HELP,
                         formatter_class=DefaultsHelpFormatter)
    add_train_arguments(t, monitor=monitor)
    return t


def config_from_args(ns: argparse.Namespace) -> TrainConfig:
    """The `TrainConfig` the flags spell (``ns`` from `train_parser`, which records the flags
    given): the plan (``--plan FILE``, else `DEFAULT_PLAN`) with the given plan flags applied,
    and the executor's sections. A Hugging Face directory (``--hf-model``) is the model unless
    a plan names one. Raises ConfigError naming the flag or the plan file."""
    given = set(ns.given) & set(PLAN_DESTS)
    sections = {name: cls(**values_from_args(cls, ns)) for name, cls in SECTIONS.items()}
    hf_model = sections["inputs"].hf_model
    if hf_model and not ns.plan:
        clash = sorted(set(given) & (set(HF_FIELDS) | {"model"}))
        if clash:
            raise ConfigError(f"--hf-model {hf_model} takes the model's shape from its "
                              f"config.json; drop {', '.join(BY_DEST[d].flag for d in clash)} "
                              "(or edit config.json)")
    try:
        base = pipesim.Plan.from_json(ns.plan) if ns.plan else DEFAULT_PLAN
        plan = apply_flags(base, ns, given)
    except PlanError as exc:
        raise ConfigError(f"--plan {ns.plan}: {exc}" if ns.plan else str(exc)) from None
    views = {d: getattr(ns, d) for d in _SCHEDULE_FLAGS if d in given}
    config = TrainConfig(plan, **sections).with_flat(**views)
    if hf_model and not ns.plan:          # after the flags: its sequence length is the run's
        config = config.with_hf_model(hf_model)
    return config


def prepare_for(ns: argparse.Namespace, config: TrainConfig, world: int) -> PreparedRun:
    """The run validated once (`pipeexec.run.prepare`), its error naming ``--plan FILE`` when
    the run is a plan file's."""
    try:
        return prepare(config, world_size=world)
    except ConfigError as exc:
        if ns.plan:
            raise ConfigError(f"--plan {ns.plan}: {exc}") from None
        raise


def train_main(args: list[str]) -> None:
    """``pipeexec train ARGS``: check everything, then train in local workers (or as this
    process's rank under torchrun); exits with 0, 1 (a run failed), 2 (bad input) or 130."""
    ns = train_parser().parse_args(args)
    from ..checkpoint import CheckpointError, read_tracker
    from ..launching.cpu_quota import QuotaUnavailable
    from ..launching.devices import cuda_device_count, may_use_cuda, start_method_for
    from ..launching.launcher import WorkerFailed, launch
    from ..models import worker_modules
    from ..run.preflight import check_train
    from ..run.worker import WorkerArgs, run_training

    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun else (ns.nproc or 1)
    try:
        config = config_from_args(ns)
        if not under_torchrun:
            world = ns.nproc or config.world_size
        prepared = prepare_for(ns, config, world)      # before any process group exists
        checkpoint = options_from_args(ns)
        if checkpoint.load is not None:
            read_tracker(checkpoint.load)       # a bad --load fails before any worker starts
        profile = profile_from_args(ns)
        evaluation = evaluation_from_args(ns, config)
        logging = logging_from_args(ns)
        if under_torchrun and ns.cpus_per_rank is not None:
            raise ConfigError("--cpus-per-rank confines the workers of a local run; under "
                              "torchrun, set CPU limits where the processes are started")
        device, backend = config.runtime.device, config.runtime.backend
        if (device or "").startswith("cuda") and cuda_device_count() == 0:
            raise ConfigError(f"--device {device}: no CUDA device is visible here (NVML "
                              "counts none; check the driver and CUDA_VISIBLE_DEVICES), or use "
                              "--device cpu")
        if ns.cpus_per_rank is not None and may_use_cuda(device, backend):
            raise ConfigError("--cpus-per-rank is for CPU runs: on CUDA it would throttle the "
                              "threads that launch kernels and drive NCCL (drop it, or use "
                              "--device cpu)")
        checks = check_train(config, checkpoint, nproc=world, cpus_per_rank=ns.cpus_per_rank,
                             timeout=ns.timeout)
        first = not under_torchrun or os.environ.get("RANK") == "0"
        for warning in checks.warnings if first else ():
            print(f"pipeexec: warning: {warning}", file=sys.stderr, flush=True)
        if checks.nothing_to_train and not evaluation.eval_only:
            if first:
                print(f"pipeexec: {checks.nothing_to_train}", flush=True)
            sys.exit(0)
        args = WorkerArgs(config, ns.metrics_out, progress=not ns.no_progress,
                          checkpoint=checkpoint, profile=profile, evaluation=evaluation,
                          logging=logging, prepared=prepared)
        if under_torchrun:
            run_training(None, args)
        else:
            launch(run_training, world, (args,), timeout=ns.timeout, cpus_per_rank=ns.cpus_per_rank,
                   start_method=start_method_for(device, backend),
                   preload=worker_modules(config))
    except KeyboardInterrupt as exc:
        # The launcher's cleanup has run (every worker stopped, quotas removed) on the way here;
        # SIGTERM / SIGHUP arrive as its Stopped, Ctrl-C as a plain KeyboardInterrupt.
        stopped = "" if under_torchrun else f": stopped {world} worker{'s' if world != 1 else ''}"
        how = f"stopped by {exc.signal_name}" if hasattr(exc, "signal_name") else "interrupted"
        print(f"\npipeexec: {how}{stopped}", file=sys.stderr, flush=True)
        sys.exit(getattr(exc, "exit_status", 130))
    except (ConfigError, pipesim.ScheduleError, ValueError, QuotaUnavailable) as exc:
        print(f"pipeexec: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except (WorkerFailed, CheckpointError) as exc:
        print(f"pipeexec: error: {exc}", file=sys.stderr)
        sys.exit(1)
    except RuntimeError as exc:   # under torchrun: PipelineError, P2PError, TopologyError ...
        print(f"pipeexec: error: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)

