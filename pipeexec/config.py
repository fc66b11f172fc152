"""`TrainConfig`: what a run is, as one plain value: a `pipesim.Plan` (model, parallelism,
cluster, schedule, partition: the one description of what is run, read by simulator and
executor alike) plus the sections only the executor has: its own layout knobs, the data and
weights, the optimizer, loss scaling and the runtime.

Each fact is stored once and read where it lives (``config.plan.parallelism.pp``,
``config.optimizer.lr``), so a reader says which object it depends on. Flat names (``pp``,
``layers``, ``lr``) belong to the edges that spell a run flat: the command line and scripts
(`TrainConfig.from_flat`, `TrainConfig.with_flat`) and the stored flat form older pipeexecs
wrote (`TrainConfig.to_dict` / `from_dict`, `legacy_flat`). The CLI builds the config
(`pipeexec.cli.train`: the plan's flags from `pipesim.plan.flags`, the rest generated from the
sections' fields), the launcher pickles it to the workers, a checkpoint and a measured run store
it (`to_dict`) and compare it on load. Nothing reads configuration from module globals.
``validate`` checks everything that can be checked without a process group, including what of
the plan the executor cannot run (`pipeexec.refusals`), so a bad run fails before any process
starts, with every reason.
"""
from __future__ import annotations

import dataclasses
import math
import os
from argparse import SUPPRESS, BooleanOptionalAction
from dataclasses import dataclass, field
from typing import Any

import pipesim
from pipesim.errors import PlanError
from pipesim.plan.model import ModelSpec
from pipesim.plan.parallelism import PRECISIONS, RECOMPUTE, Parallelism
from pipesim.plan.plan import Plan
from pipesim.schedule.io import schedule_from_csv, schedule_from_dict, schedule_from_json
from pipesim.schedule.placement import PLACEMENTS as PLACEMENT_CHOICES
from pipesim.schedule.registry import schedule_refusal
from pipesim.schedule.schedule import Schedule
from pipesim.units import bytes_arg

from .errors import ConfigError
from .models.hf_config import HFModelError, plan_model_of
from .flag_fields import flag_of, flagged
from .flag_fields import option as _opt
from .partition import PartitionError, explicit, plan_bounds
from .refusals import refusals

__all__ = ["ConfigError", "TrainConfig", "DEFAULT_PLAN", "GPT_MODEL", "PRECISIONS", "RECOMPUTE",
           "PARTITIONS", "PLAN_VIEWS"]

PARTITIONS = ("layers", "params")

# The built-in GPT's default shape and pipeexec's base plan: one process, one microbatch, fp32,
# context parallelism's K/V exchanged as pipeexec.parallel.context does it (all-gathered).
# The executor never pads the vocabulary (pipesim's default pads to 128, as Megatron does).
GPT_MODEL = ModelSpec("pipeexec-gpt", layers=2, hidden=64, heads=4, seq_length=32, vocab=256,
                      tied_embeddings=False, dropout=False, vocab_divisible_by=1)
DEFAULT_PLAN = Plan(GPT_MODEL, Parallelism(precision="fp32", cp_comm="all_gather"),
                    schedule="1f1b")

# Flat names of the plan's facts: parallelism fields by their own name, the model's by the
# executor's (seq_len = model.seq_length, tie_embeddings = model.tied_embeddings).
_PARALLELISM = ("tp", "cp", "ep", "pp", "vpp", "dp", "sequence_parallel", "zero",
                "micro_batch_size", "recompute", "recompute_layers", "precision", "grad_reduce")
MODEL_VIEWS = {"layers": "layers", "hidden": "hidden", "heads": "heads", "kv_heads": "kv_heads",
          "ffn_hidden": "ffn_hidden", "seq_len": "seq_length", "vocab": "vocab",
          "tie_embeddings": "tied_embeddings"}
PLAN_VIEWS = ("schedule", "placement", *_PARALLELISM, "microbatches", *MODEL_VIEWS)


def _ints(text: Any) -> tuple[int, ...] | None:
    if text is None or isinstance(text, tuple):
        return text
    try:
        return tuple(int(x) for x in str(text).split(","))
    except ValueError:
        raise ConfigError(f"--boundaries must be comma-separated integers, got {text!r}") from None


def _flag(section: Any, name: str) -> str:
    """The command-line flag of field ``name`` of ``section``."""
    return flag_of(next(f for f in dataclasses.fields(section) if f.name == name))


def _number(section: Any, name: str, *, low: float = 0.0, strict: bool = False,
            high: float | None = None, hint: str = "") -> None:
    """ConfigError unless field ``name`` of ``section`` is a finite number in the bounds."""
    v = getattr(section, name)
    ok = (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
          and (v > low if strict else v >= low) and (high is None or v <= high))
    if not ok:
        bound = f"{'>' if strict else '>='} {low:g}" + (f" and <= {high:g}" if high is not None else "")
        raise ConfigError(f"{name} must be a finite number {bound}{hint}, got {v!r}")


def _integer(section: Any, name: str, low: int) -> None:
    v = getattr(section, name)
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise ConfigError(f"{name} must be an integer >= {low}, got {v!r}")


def plan_cuts_itself(plan: Plan) -> bool:
    """Whether ``plan`` spells its own cut (explicit partition, Megatron's layout or
    first/last-stage counts, embedding or loss accounted as layers)."""
    return (plan.partition is not None or plan.partition_layout is not None
            or plan.first_stage_layers is not None or plan.last_stage_layers is not None
            or plan.account_for_embedding or plan.account_for_loss)


# Steps a zb-auto run trains before it profiles: step 0 builds the runtime, and step 1 still
# ran ~40% over the steady step at vpp 2 on CPU (76.7 vs 53.7 ms, ZB-V pp 2), which inflated
# the costs the search predicts from.
RESCHEDULE_WARMUP_STEPS = 2


@dataclass(frozen=True)
class LayoutConfig:
    """The executor's layout knobs that are not plan fields: zb-auto re-scheduled from the
    run's own profiled steps, and stage cuts a plan does not spell (by parameter counts, or
    explicit boundaries in the layer list)."""

    # zb-auto: profile `reschedule_after` steps of ZB-H1 (after RESCHEDULE_WARMUP_STEPS warm-up
    # steps), search a schedule from the measured costs under `memory_limit` bytes per rank,
    # switch to it
    memory_limit: float | None = _opt(
        None, "with --schedule zb-auto: profile --reschedule-after steps of ZB-H1, search "
        "zb-auto from the measured costs under this per-rank limit (e.g. 2GB), switch to it",
        type=bytes_arg, metavar="BYTES")
    reschedule_after: int = _opt(2, "with --memory-limit: profiled steps (ZB-H1; at --vpp 2 "
                                 "ZB-V, or zb-auto's uniform-cost order when looped) before "
                                 "zb-auto takes over", type=int, metavar="K")
    reschedule_margin: float = _opt(
        0.05, "with --memory-limit: keep the fastest hand-made order that fits unless one of "
        "zb-auto's own is predicted faster by more than this fraction (about the accuracy of "
        "predictions from a run's own steps; 0: trust every predicted gain)", type=float,
        metavar="FRACTION")
    # partitioning: "layers" (the plan's cut: pipesim's even split, or its partition fields),
    # "params" (balanced parameter counts) or explicit boundaries: the first global layer
    # index of every stage after the first.
    partition: str = _opt("layers", "cut the layers into stages as the plan does (equal "
                          "transformer-block counts, the first stages one more, unless the plan "
                          "gives its own partition) or of balanced parameter counts",
                          choices=PARTITIONS)
    boundaries: tuple[int, ...] | None = _opt(
        None, "explicit stage boundaries: first layer index of stages 1..S-1, comma separated",
        parse=_ints)

    def validate(self, plan: Plan, *, num_layers: int | None = None, steps: int = 1,
                 forward_only: bool = False) -> None:
        """The cut of ``plan``'s layers into its stages (``num_layers``: the length of a
        caller's own layer stack; None: the plan's model's), and zb-auto's re-scheduling under
        ``memory_limit`` within a run of ``steps`` that trains."""
        if self.partition not in PARTITIONS:
            raise ConfigError(f"partition must be one of {', '.join(PARTITIONS)}, got {self.partition!r}")
        stages = plan.parallelism.pp * plan.parallelism.vpp
        n_layers = plan.model.layers + 2 if num_layers is None else num_layers
        if n_layers < stages:
            raise ConfigError(f"the model has {n_layers} layers (embedding + {n_layers - 2} blocks + "
                              f"head) but pp * vpp = {stages} stages need at least one each")
        if self.boundaries is not None:
            try:
                explicit(self.boundaries, n_layers, stages)
            except PartitionError as exc:
                raise ConfigError(str(exc)) from None
            if plan_cuts_itself(plan):
                raise ConfigError("boundaries: the plan cuts the layers itself (its partition "
                                  "fields); give one cut, drop --boundaries or the plan's")
        elif num_layers is None and self.partition == "layers":
            try:
                plan_bounds(plan)
            except PartitionError as exc:
                raise ConfigError(str(exc)) from None
        if self.memory_limit is not None:
            self._validate_memory_limit(plan, steps=steps, forward_only=forward_only)

    def _validate_memory_limit(self, plan: Plan, *, steps: int, forward_only: bool) -> None:
        schedule = plan.schedule_name
        par, model = plan.parallelism, plan.model
        if schedule != "zb-auto":
            raise ConfigError(f"memory_limit applies to the zb-auto schedule (a search under "
                              f"it), got schedule {schedule!r}")
        if isinstance(self.memory_limit, bool) or not isinstance(
                self.memory_limit, (int, float)) or not (
                math.isfinite(self.memory_limit) and self.memory_limit > 0):
            raise ConfigError(f"memory_limit (--memory-limit) must be a finite number of "
                              f"bytes > 0, got {self.memory_limit!r}")
        floor = par.micro_batch_size * model.seq_length * model.hidden * (
            4 if par.precision == "fp32" else 2)
        if self.memory_limit < floor:   # the workers' check_memory_limit, before start-up
            raise ConfigError(
                f"memory_limit (--memory-limit) {self.memory_limit:g} bytes is below what "
                f"one microbatch needs on a rank (at least {floor:g} bytes: its input "
                "activation, micro_batch_size x seq_len x hidden values of the compute "
                "dtype); raise --memory-limit")
        if par.vpp not in (1, 2) or forward_only:
            raise ConfigError(f"zb-auto with a memory_limit trains with vpp = 1 or 2 and a "
                              f"backward, got vpp = {par.vpp}"
                              + (" and forward_only" if forward_only else ""))
        if isinstance(self.reschedule_margin, bool) or not (
                isinstance(self.reschedule_margin, (int, float))
                and 0 <= self.reschedule_margin < 1):
            raise ConfigError(f"reschedule_margin must be a fraction in [0, 1) (0.05: 5%), "
                              f"got {self.reschedule_margin!r}")
        if not isinstance(self.reschedule_after, int) or self.reschedule_after < 1:
            raise ConfigError(f"reschedule_after must be a positive integer, got "
                              f"{self.reschedule_after!r}")
        first = RESCHEDULE_WARMUP_STEPS
        need = first + self.reschedule_after + 1
        if steps < need:
            raise ConfigError(f"steps = {steps}: zb-auto profiles steps {first}.."
                              f"{first + self.reschedule_after - 1} (after {first} warm-up "
                              f"steps) before it searches, so it needs steps >= {need}")


@dataclass(frozen=True)
class DataConfig:
    """What the run trains on, and where a Hugging Face model's weights come from."""

    data: str = _opt("synthetic", "'synthetic' or a text file (byte-level tokens, or "
                     "--tokenizer's), cut into random windows: for quick runs")
    # Megatron's --data-path: indexed datasets (pipeexec preprocess-data), blended by weight,
    # split by document, shuffled per the seed (pipeexec/datasets)
    data_path: tuple[str, ...] = _opt(
        (), "train on Megatron indexed datasets: PREFIX (PREFIX.bin, PREFIX.idx, as "
        "pipeexec preprocess-data writes them), several, or weight / prefix pairs W1 P1 W2 P2 "
        "blended by weight (Megatron's --data-path)", nargs="+", metavar="PREFIX",
        parse=tuple)
    split: str = _opt("969,30,1", "with --data-path: train, validation, test shares of each "
                      "corpus's documents (Megatron's --split)")
    tokenizer: str | None = _opt(
        None, "a Hugging Face tokenizer folder (local, e.g. save_pretrained's): --data FILE is "
        "tokenized with it instead of read as bytes; its vocabulary (with --data-path too) is "
        "checked against --vocab before the run", metavar="DIR")
    # a Hugging Face model directory: its config.json is the plan's model, its safetensors
    # (when it has any) the initial weights (pipeexec/models/hf.py)
    hf_model: str | None = _opt(
        None, "train a Hugging Face model directory: config.json (llama, mistral, mixtral, qwen2 "
        "or gpt2) is the model, as --model config.json makes it, and its *.safetensors (when it "
        "has any) the initial weights; the model-shape flags then come from config.json",
        metavar="DIR")

    def validate(self, model: ModelSpec) -> None:
        """The text file or the indexed datasets (``--data-path``, ``--split``: O(1) per
        corpus) fit ``model``'s vocabulary and sequence length."""
        if self.data != "synthetic" and model.vocab < 256 and self.tokenizer is None:
            raise ConfigError(f"a text file needs vocab >= 256 (byte-level tokens), got {model.vocab}")
        if self.data_path:
            if self.data != "synthetic":
                raise ConfigError(f"give --data {self.data} or --data-path, not both")
            from .datasets import DataPathError, check_data_path

            try:
                # (a run that evaluates checks its validation split too: EvalOptions.validate)
                check_data_path(self.data_path, self.split, model.seq_length)
            except DataPathError as exc:
                raise ConfigError(str(exc)) from None
        if self.data != "synthetic":
            if os.path.isdir(self.data):
                raise ConfigError(f"data: {self.data!r} is a directory; --data takes "
                                  "'synthetic' or a text file")
            if not os.path.isfile(self.data):
                raise ConfigError(f"data: file {self.data!r} does not exist ('synthetic' or a "
                                  "text file)")
            if os.path.getsize(self.data) < model.seq_length + 2:
                raise ConfigError(f"data: file {self.data!r} has {os.path.getsize(self.data)} "
                                  f"bytes, fewer than seq_len + 2 = {model.seq_length + 2}")


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW, its learning-rate schedule and gradient clipping."""

    steps: int = _opt(1, "optimizer iterations in total", type=int)
    lr: float = _opt(1e-3, "peak learning rate (AdamW)", type=float)
    min_lr: float = _opt(0.0, "learning rate at the end of the decay", type=float)
    warmup_steps: int = _opt(0, "linear LR warm-up iterations", type=int)
    decay_steps: int | None = _opt(None, "cosine decay length in iterations (default: --steps); "
                                   "fix it to stop a run early and resume it on the same LR "
                                   "curve", type=int)
    weight_decay: float = _opt(0.01, "AdamW weight decay", type=float)
    beta1: float = _opt(0.9, "AdamW beta1", type=float)
    beta2: float = _opt(0.95, "AdamW beta2", type=float)
    eps: float = _opt(1e-8, "AdamW epsilon", type=float)
    clip_grad: float = _opt(1.0, "global-norm clip (0: off)", type=float)

    def validate(self) -> None:
        """Finite rates, betas below 1, whole step counts."""
        _number(self, "lr", hint=" (--lr)")
        _number(self, "min_lr", high=self.lr, hint=" and at most --lr (--min-lr)")
        _number(self, "weight_decay")
        _number(self, "clip_grad", hint=" (0: no clipping)")
        _number(self, "beta1", high=1.0 - 1e-12)
        _number(self, "beta2", high=1.0 - 1e-12)
        _number(self, "eps", strict=True)
        _integer(self, "warmup_steps", 0)
        if self.decay_steps is not None and (not isinstance(self.decay_steps, int)
                                             or self.decay_steps < 1):
            raise ConfigError(f"decay_steps must be a positive integer (or unset: --steps), got "
                              f"{self.decay_steps!r}")


@dataclass(frozen=True)
class PrecisionConfig:
    """fp16's dynamic loss scaling (the compute precision is the plan's)."""

    loss_scale: float = _opt(2.0 ** 16, "initial dynamic loss scale (fp16)", type=float)
    loss_scale_growth_interval: int = _opt(
        1000, "fp16: double the loss scale after this many steps without overflow", type=int)
    loss_scale_backoff: float = _opt(0.5, "fp16: factor the loss scale shrinks by on overflow",
                                     type=float)
    loss_scale_growth: float = _opt(2.0, "fp16: factor the loss scale grows by", type=float)
    min_loss_scale: float = _opt(1.0, "fp16: the loss scale never goes below this", type=float)
    max_skipped_steps: int = _opt(
        100, "fp16: stop with an error after more than this many consecutive steps skipped for "
        "overflow (the default scale reaches its floor in 16; fp32 and bf16 stop at the first "
        "non-finite loss or gradient)", type=int, metavar="N")

    def validate(self) -> None:
        """A positive scale that grows by more than 1 and backs off by at most 1."""
        _number(self, "loss_scale", strict=True)
        _number(self, "min_loss_scale", strict=True)
        _number(self, "loss_scale_backoff", strict=True, high=1.0)
        _number(self, "loss_scale_growth", low=1.0)
        _integer(self, "loss_scale_growth_interval", 1)
        _integer(self, "max_skipped_steps", 1)


@dataclass(frozen=True)
class RuntimeConfig:
    """How the executor runs: seed, transports, devices, timeouts, fault injection."""

    seed: int = _opt(0, "seed of the weights, data and dropout", type=int)
    forward_only: bool = _opt(False, "evaluate: run the schedule's forward-only variant, no "
                              "backward, no optimizer step", action="store_true")
    deallocate_outputs: bool = _opt(True, "free a stage's output once sent (Megatron's "
                                    "deallocate_output_tensor)", action=BooleanOptionalAction)
    recv_lookahead: int = _opt(1, "post each receive this many computations before the one "
                               "that needs it (0: right before it); the simulator models the "
                               "same schedule", type=int)
    cpu_keep_freed_memory: bool = _opt(
        True, "CPU: let malloc give freed memory back to the kernel (by default it is kept for "
        "the next step, which saves a page fault per fresh page; pipeexec/malloc.py)",
        flag="--cpu-return-freed-memory", action="store_true", invert=True)
    p2p_timeout: float = _opt(300.0, "seconds per send/receive", type=float)
    # gloo emulating NCCL's point-to-point matching: tags ignored, a group's transfers between
    # two ranks matched in posting order (finds posting-order bugs on CPU; pipeexec/pipeline/p2p.py)
    nccl_matching: bool = _opt(
        False, "gloo on CPU matching point-to-point transfers as NCCL does (tags ignored, in "
        "posting order per group and pair of ranks): shows on CPU what a NCCL run would get",
        action="store_true")
    collective_timeout: float = _opt(600.0, "seconds a collective (and process-group set-up) "
                                     "may take", type=float)
    backend: str | None = _opt(None, "nccl or gloo (default: nccl with CUDA, else gloo)")
    device: str | None = _opt(None, "cpu or cuda (default: cuda when available); cuda means "
                              "cuda:<local rank %% visible GPUs> (pipeexec/launching/devices.py)")
    # fault injection, for tests of the failure paths (never set in normal runs):
    # "raise:RANK:STEP:ACTION" raises in that action, "exit:RANK:STEP:ACTION" kills the process
    # there (SIGKILL), "hang:RANK:STEP:ACTION" blocks there forever, "overflow:STEP" puts an inf
    # into one gradient of the last stage at that step.
    inject: tuple[str, ...] = _opt((), SUPPRESS, action="append")

    def validate(self) -> None:
        """Receives posted ahead by a whole number of computations, NCCL's matching emulated on
        gloo only, finite timeouts (nan passes ``<= 0``; inf overflows a timedelta)."""
        if not isinstance(self.recv_lookahead, int) or self.recv_lookahead < 0:
            raise ConfigError(f"recv_lookahead must be a non-negative integer, got {self.recv_lookahead!r}")
        if not isinstance(self.nccl_matching, bool):
            raise ConfigError(f"nccl_matching must be true or false, got {self.nccl_matching!r}")
        if self.nccl_matching and (self.backend == "nccl" or
                                   (self.device or "").startswith("cuda")):
            raise ConfigError("nccl_matching emulates NCCL's matching on gloo (CPU); with "
                              f"backend={self.backend!r} device={self.device!r} it does not apply: "
                              "drop --nccl-matching, or run with --device cpu")
        for name in ("p2p_timeout", "collective_timeout"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (
                    math.isfinite(v) and v > 0):
                raise ConfigError(f"{name} ({_flag(self, name)}) must be a finite number of "
                                  f"seconds > 0, got {v!r}")


SECTIONS: dict[str, type] = {"layout": LayoutConfig, "inputs": DataConfig,
                             "optimizer": OptimizerConfig, "mixed_precision": PrecisionConfig,
                             "runtime": RuntimeConfig}
# field name -> the section holding it
_SECTION_OF = {f.name: name for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)}


def _plan_with(plan: Plan, views: dict[str, Any]) -> Plan:
    """``plan`` with flat plan views changed. The microbatches per replica stay as they are
    unless given, whatever dp or the micro-batch size become (the global batch follows)."""
    views = dict(views)
    given = sorted(views)
    par, model = plan.parallelism, plan.model
    batch = {k: views.pop(k) for k in ("microbatches", "micro_batch_size", "dp") if k in views}
    par_changes = {k: views.pop(k) for k in _PARALLELISM if k in views}
    par_changes.update({k: v for k, v in batch.items() if k != "microbatches"})
    model_changes = {MODEL_VIEWS[k]: views.pop(k) for k in list(views) if k in MODEL_VIEWS}
    plan_changes: dict[str, Any] = {}
    if "schedule" in views:
        plan_changes["schedule"] = views.pop("schedule")
    if "placement" in views:
        options = dict(plan.schedule_options)
        placement = views.pop("placement")
        if placement is None:
            options.pop("placement", None)
        else:
            options["placement"] = placement
        plan_changes["schedule_options"] = tuple(sorted(options.items()))
    assert not views, views
    try:
        if par_changes:
            par = par.with_(**par_changes)
        if batch:
            m = batch.get("microbatches", plan.microbatches)
            if isinstance(m, bool) or not isinstance(m, int) or m < 1:
                raise ConfigError(f"microbatches must be a positive integer, got {m!r}")
            par = par.with_(global_batch_size=m * par.micro_batch_size * par.dp)
        if model_changes:
            model = model.with_(**model_changes)
    except PlanError as exc:
        raise ConfigError(f"{exc} ({', '.join(TrainConfig.flag(k) for k in given)})") from None
    except TypeError as exc:              # a value of the wrong type in a shape's arithmetic
        raise ConfigError(f"plan: {exc}") from None
    return dataclasses.replace(plan, parallelism=par, model=model, **plan_changes)


@dataclass(frozen=True)
class TrainConfig:
    """A run: ``plan`` (what is run) and the executor's own sections ``layout``, ``inputs``,
    ``optimizer``, ``mixed_precision``, ``runtime`` (checkpointing and profiling are
    `CheckpointOptions` and `ProfileOptions`). Each reads as itself: ``config.plan.parallelism.pp``,
    ``config.plan.model.layers``, ``config.optimizer.lr``; what several rooms derive from them
    has a name here (`world_size`, `num_stages`, `global_batch`, `num_layers`, `placement`).

    Flat names (``pp``, ``layers``, ``lr``: `PLAN_VIEWS` and the sections' fields, the names of
    the command line's flags and of the stored flat form) are the edge's spelling, translated
    in one place: `from_flat` and `with_flat` write them, `to_flat` reads them."""

    plan: Plan = DEFAULT_PLAN
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    inputs: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    mixed_precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.plan, Plan):
            raise TypeError(f"TrainConfig: plan must be a pipesim.Plan, got "
                            f"{type(self.plan).__name__}")
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise TypeError(f"TrainConfig: {name} must be a {cls.__name__}, got "
                                f"{type(getattr(self, name)).__name__}")

    # -- the flat edge: the command line's and scripts' names ---------------------------------
    @classmethod
    def from_flat(cls, plan: Plan = DEFAULT_PLAN, **fields: Any) -> "TrainConfig":
        """The entry of the command line and of scripts: a run given by flat names
        (``TrainConfig.from_flat(pp=2, layers=4, lr=3e-4)``) over ``plan`` (default: the
        built-in GPT's `DEFAULT_PLAN`) and the sections' defaults; see `with_flat`."""
        return cls(plan=plan).with_flat(**fields)

    def with_flat(self, **fields: Any) -> "TrainConfig":
        """A copy with flat fields changed: each plan view (`PLAN_VIEWS`) written into the plan,
        each section field into its section. The microbatches per replica stay as they are
        unless given, whatever dp or the micro-batch size become (the global batch follows).
        TypeError for a name that is no field; ConfigError for a plan the values break."""
        views: dict[str, Any] = {}
        routed: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for key, value in fields.items():
            if key in PLAN_VIEWS:
                views[key] = value
            elif key in _SECTION_OF:
                routed[_SECTION_OF[key]][key] = value
            else:
                raise TypeError(f"TrainConfig: unknown field {key!r}")
        changes: dict[str, Any] = {name: dataclasses.replace(getattr(self, name), **values)
                                   for name, values in routed.items() if values}
        if views:
            changes["plan"] = _plan_with(self.plan, views)
        return dataclasses.replace(self, **changes)

    def to_flat(self) -> dict[str, Any]:
        """Every flat field -> its value: the plan's views (`PLAN_VIEWS`), then the sections'
        fields (what `to_dict` stores flat, and what a stored flat form is compared with)."""
        out: dict[str, Any] = {name: plan_view(self.plan, name) for name in PLAN_VIEWS}
        for name in SECTIONS:
            section = getattr(self, name)
            out.update({f.name: getattr(section, f.name) for f in dataclasses.fields(section)})
        return out

    @staticmethod
    def field_names() -> tuple[str, ...]:
        """Every flat field: the plan's views, then the sections' fields."""
        return PLAN_VIEWS + tuple(_SECTION_OF)

    @staticmethod
    def cli_fields() -> list[dataclasses.Field]:
        """The section fields that have a command-line flag, in section order (the plan's
        flags are `pipesim.plan.flags`')."""
        return [f for cls in SECTIONS.values() for f in flagged(cls)]

    @staticmethod
    def flag(name: str) -> str:
        """The command-line flag that sets field ``name`` (``name (no flag)`` when none)."""
        if name in PLAN_VIEWS:
            return _VIEW_FLAGS.get(name, "--" + name.replace("_", "-"))
        f = next((f for cls in SECTIONS.values() for f in dataclasses.fields(cls)
                  if f.name == name), None)
        if f is None:                   # a launcher option (--cpus-per-rank, --nproc...)
            return "--" + name.replace("_", "-")
        if f.metadata.get("flag") is None:
            return f"{name} (no flag)"
        return flag_of(f)

    # -- what several rooms derive from the plan -----------------------------------------------
    @property
    def world_size(self) -> int:
        """Processes the run takes: tp * cp * pp * dp."""
        return self.plan.parallelism.world_size

    @property
    def num_stages(self) -> int:
        """Pipeline stages: pp * vpp."""
        return self.plan.parallelism.num_stages

    @property
    def global_batch(self) -> int:
        """Sequences per step over every replica: dp * microbatches * micro_batch_size."""
        par = self.plan.parallelism
        return par.dp * self.plan.microbatches * par.micro_batch_size

    @property
    def model(self) -> ModelSpec:
        """The plan's model (pipesim's `ModelSpec`: the one model shape)."""
        return self.plan.model

    @property
    def num_layers(self) -> int:
        """Length of the layer stack the plan's model is built as: embedding, blocks, head."""
        return self.plan.model.layers + 2

    @property
    def placement(self) -> str | None:
        """Where zb-auto puts its stages at vpp 2 (``looped`` or ``v``; None: searched), a
        schedule option of the plan."""
        return plan_view(self.plan, "placement")

    def plan_as_run(self) -> Plan:
        """The plan as this run cuts it: the plan itself, or with the executor's own cut
        (``boundaries``) written in as its partition (blocks per stage), so pipesim predicts
        the stages that run. ConfigError for a cut by parameter counts without boundaries (it
        needs the layers' parameter counts: give --boundaries)."""
        layout = self.layout
        if layout.boundaries is None and layout.partition == "layers":
            return self.plan
        if layout.boundaries is None:
            raise ConfigError("a plan holds an explicit partition: with --partition params, give "
                              "the cut as --boundaries")

        try:
            bounds = explicit(layout.boundaries, self.num_layers, self.num_stages)
        except PartitionError as exc:
            raise ConfigError(str(exc)) from None
        last = self.plan.model.layers + 1
        blocks = [min(b1, last) - max(b0, 1) for b0, b1 in zip(bounds, bounds[1:])]
        return dataclasses.replace(self.plan, partition=tuple(blocks), partition_layout=None,
                                   first_stage_layers=None, last_stage_layers=None,
                                   account_for_embedding=False, account_for_loss=False)

    def with_hf_model(self, path: str) -> "TrainConfig":
        """A copy training the Hugging Face model directory ``path``: the plan's model is its
        config.json (`ModelSpec.from_hf_config`, this run's sequence length), its safetensors
        the weights (raises ConfigError with the reason)."""

        try:
            model = plan_model_of(path, seq_length=self.plan.model.seq_length)
        except HFModelError as exc:
            raise ConfigError(str(exc)) from None
        return self.replace(plan=dataclasses.replace(self.plan, model=model),
                            inputs=dataclasses.replace(self.inputs, hf_model=str(path)))

    def replace(self, **changes: Any) -> "TrainConfig":
        """A copy with the plan or whole sections changed (flat names: `with_flat`)."""
        flat = sorted(set(changes) - {"plan", *SECTIONS})
        if flat:
            raise TypeError(f"TrainConfig.replace takes the plan and whole sections; "
                            f"{', '.join(flat)}: flat names, given to with_flat")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """What checkpoints and measured runs store: ``plan`` (`Plan.to_dict`) and, flat,
        field -> value for every field, the plan's views included (as older pipeexecs wrote
        it: readers of either read the same flat keys)."""
        out: dict[str, Any] = {name: _jsonable(plan_view(self.plan, name)) for name in PLAN_VIEWS}
        for name in SECTIONS:
            out.update(dataclasses.asdict(getattr(self, name)))
        out["plan"] = self.plan.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        """From `to_dict`'s form, or the flat form pipeexec wrote before its config held a plan
        (`legacy_flat`); fields it does not know are refused (TypeError)."""
        values = legacy_flat(data)
        plan = values.pop("plan", None)
        for k in ("boundaries", "inject", "data_path"):
            if isinstance(values.get(k), list):
                values[k] = tuple(values[k])
        if plan is not None:
            try:
                plan = Plan.from_dict(plan, source="config: plan")
            except PlanError as exc:
                raise ConfigError(str(exc)) from None
            values = {k: v for k, v in values.items() if k not in PLAN_VIEWS}
            return cls.from_flat(plan, **values)
        # the older flat form: the views hold the plan's facts (kv_heads, ffn_hidden resolved:
        # their defaults, heads and 4 x hidden, stay the model's defaults)
        hidden, heads = values.get("hidden", GPT_MODEL.hidden), values.get("heads", GPT_MODEL.heads)
        if values.get("ffn_hidden") == 4 * hidden:
            values.pop("ffn_hidden")
        if values.get("kv_heads") == heads:
            values.pop("kv_heads")
        return cls.from_flat(**values)

    def validate(self, world_size: int | None = None, num_layers: int | None = None, *,
                 check_schedule: bool = True) -> "TrainConfig":
        """Raise ConfigError naming the field: first everything of the plan the executor cannot
        run, all at once (`pipeexec.refusals`), then each section by its own ``validate`` (the
        plan's facts it needs passed in); build the schedule to check it accepts the layout
        (``check_schedule=False`` when the caller brings its own Schedule). ``num_layers``: the
        length of a caller's own layer stack."""

        refused = refusals(self, custom_stack=num_layers is not None)
        if refused:
            raise ConfigError("the plan asks for what pipeexec cannot run:\n  "
                              + "\n  ".join(refused))
        par = self.plan.parallelism
        if world_size is not None and world_size != self.world_size:
            raise ConfigError(f"world size {world_size} != tp * cp * pp * dp = {par.tp} * "
                              f"{par.cp} * {par.pp} * {par.dp} = {self.world_size}")
        self.layout.validate(self.plan, num_layers=num_layers, steps=self.optimizer.steps,
                             forward_only=self.runtime.forward_only)
        self.inputs.validate(self.plan.model)
        self.optimizer.validate()
        self.mixed_precision.validate()
        self.runtime.validate()
        placement = self.placement
        if placement is not None:
            if placement not in PLACEMENT_CHOICES:
                raise ConfigError(f"placement must be one of {', '.join(PLACEMENT_CHOICES)}, got "
                                  f"{placement!r}")
            schedule = self.plan.schedule_name
            if schedule != "zb-auto" or par.vpp != 2:
                raise ConfigError(f"placement chooses where zb-auto puts its stages at vpp = 2; "
                                  f"got schedule {schedule!r} with vpp = {par.vpp} (the "
                                  "other schedules fix their own placement)")
        if check_schedule:
            self.build_schedule()
        return self

    def build_schedule(self) -> Schedule:
        """The pipesim Schedule of this run (raises pipesim.ScheduleError with the reason): the
        plan's schedule (a name with its options, or a Schedule held as data), or a schedule
        file it names; forward-only and receives posted ``recv_lookahead`` computations early
        are the executor's."""

        sched = self.plan.schedule
        if isinstance(sched, Schedule):
            return self._fitted(sched, f"the plan's schedule {sched.name!r}")
        if sched.endswith((".json", ".csv")):
            loaded = (_schedule_json if sched.endswith(".json") else schedule_from_csv)(sched)
            return self._fitted(loaded.validate(), sched)
        par, runtime = self.plan.parallelism, self.runtime
        schedule = pipesim.build_schedule(sched, pp=par.pp, microbatches=self.plan.microbatches,
                                          vpp=par.vpp, forward_only=runtime.forward_only,
                                          recv_lookahead=runtime.recv_lookahead,
                                          **dict(self.plan.schedule_options))
        return schedule.validate()

    def _fitted(self, s: Schedule, source: str) -> Schedule:
        """A schedule given as data (a file, the plan's): it must fit this run's layout."""

        par, runtime = self.plan.parallelism, self.runtime
        why = schedule_refusal(s, par.pp, par.vpp, self.plan.microbatches, asked="the run",
                               flags=True)
        if why is not None:
            raise pipesim.ScheduleError(f"{source}: {why}")
        if runtime.forward_only:
            s = s.with_orders([[a for a in s.compute_parts(r) if a.op == "F"] for r in range(s.pp)],
                              name=f"{s.name} (forward only)", forward_only=True)
        if runtime.recv_lookahead and not s.has_explicit_comms:
            s = s.with_recv_lookahead(runtime.recv_lookahead)
        return s.validate()


def _schedule_json(path: str):
    """A schedule JSON file (pipesim.schedule.io), or a plan file (pipesim.Plan.to_json)
    holding its schedule as data."""
    import json


    try:
        with open(path, encoding="utf-8") as f:
            data = json.loads(f.read())
    except (OSError, ValueError):              # unreadable, not UTF-8, not JSON
        return schedule_from_json(path)          # its own error, naming the file
    if isinstance(data, dict) and str(data.get("format", "")).startswith("pipesim.plan"):
        if not isinstance(data.get("schedule"), dict):
            raise pipesim.ScheduleError(f"{path}: the plan names its schedule "
                                        f"({data.get('schedule')!r}) instead of holding it")
        return schedule_from_dict(data["schedule"], source=f"{path}: schedule")
    return schedule_from_dict(data, path)


# -- flat views of the plan ------------------------------------------------------------------
_VIEW_FLAGS = {"microbatches": "--microbatches", "seq_len": "--seq-len",
               "tie_embeddings": "--tie-embeddings", "kv_heads": "--kv-heads",
               "ffn_hidden": "--ffn-hidden"}


def plan_view(plan: Plan, name: str) -> Any:
    """The fact of ``plan`` that flat field ``name`` names (`PLAN_VIEWS`): the flat edge's
    reading side, for the stored flat form (`TrainConfig.to_flat`) and the command line's
    defaults."""
    if name == "schedule":
        return plan.schedule_name if isinstance(plan.schedule, Schedule) else plan.schedule
    if name == "placement":
        return dict(plan.schedule_options).get("placement")
    if name == "microbatches":
        return plan.microbatches
    if name in _PARALLELISM:
        return getattr(plan.parallelism, name)
    model = plan.model
    if name == "ffn_hidden":
        return model.ffn
    if name == "kv_heads":
        return model.num_kv_heads
    return getattr(model, MODEL_VIEWS[name])


def _jsonable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def legacy_flat(data: dict[str, Any]) -> dict[str, Any]:
    """A stored config (checkpoint, measured run) in today's flat names: pipeexec before its
    config held a plan (commit 8ef147e and earlier) wrote ``ffn_mult`` (MLP width / hidden)
    where today's views say ``ffn_hidden``, and no ``kv_heads`` (= heads). Other keys are kept
    as they are."""
    values = dict(data)
    if "ffn_mult" in values and "ffn_hidden" not in values:
        mult = values.pop("ffn_mult")
        if isinstance(mult, int) and isinstance(values.get("hidden", GPT_MODEL.hidden), int):
            values["ffn_hidden"] = mult * values.get("hidden", GPT_MODEL.hidden)
    else:
        values.pop("ffn_mult", None)
    if "plan" not in values and "kv_heads" not in values and isinstance(values.get("heads"), int):
        values["kv_heads"] = values["heads"]      # the built-in GPT's, before GQA had a field
    return values
