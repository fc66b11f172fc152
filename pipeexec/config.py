"""`TrainConfig`: every knob of a run, as one plain value, in sections by concern.

The CLI is generated from its fields (help and default on each: `TrainConfig.cli_fields`) and
builds it, the launcher pickles it to the workers, a checkpoint stores it (``asdict``)
and compares it on load. Nothing reads configuration from module globals. ``validate`` checks
everything that can be checked without a process group, so a bad layout fails before any
collective with the reason.
"""
from __future__ import annotations

import dataclasses
from argparse import SUPPRESS, BooleanOptionalAction
from dataclasses import dataclass, field
from typing import Any

from pipesim.schedule.placement import PLACEMENTS as PLACEMENT_CHOICES
from pipesim.units import bytes_arg

from .options import flag_of, flagged
from .options import option as _opt

PRECISIONS = ("fp32", "bf16", "fp16")
PARTITIONS = ("layers", "params")
RECOMPUTE = ("none", "selective", "full")


class ConfigError(ValueError):
    """A configuration that cannot run, with the field and the reason."""


def _ints(text: Any) -> tuple[int, ...] | None:
    if text is None or isinstance(text, tuple):
        return text
    try:
        return tuple(int(x) for x in str(text).split(","))
    except ValueError:
        raise ConfigError(f"--boundaries must be comma-separated integers, got {text!r}") from None


@dataclass(frozen=True)
class LayoutConfig:
    """How the run is laid out: schedule, pipeline and data parallelism, batch, stage cut."""

    schedule: str = _opt("1f1b", "a pipesim schedule name (pipesim list), or a schedule file: "
                         "FILE.json (pipesim) or FILE.csv (torch's, compute-only or with comms)")
    # zb-auto: profile `reschedule_after` steps of ZB-H1 (after a warm-up step), search a
    # schedule from the measured costs under `memory_limit` bytes per rank, switch to it
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
    # zb-auto at vpp 2 may put a rank's two stages looped (s % pp) or in a V; the stages are cut
    # before the first step, so a search from the run's own costs keeps the placement it has
    placement: str | None = _opt(
        None, "with --schedule zb-auto --vpp 2: where its stages sit, looped (Megatron's "
        "interleaved) or v (ZB-V's); default: both searched, or v with --memory-limit (the "
        "profiled ZB-V's placement)", choices=PLACEMENT_CHOICES)
    pp: int = _opt(1, "pipeline ranks", type=int)
    vpp: int = _opt(1, "stages (chunks) per pipeline rank", type=int)
    dp: int = _opt(1, "data-parallel replicas", type=int)
    microbatches: int = _opt(1, "microbatches per replica per step", type=int)
    micro_batch_size: int = _opt(1, "sequences per microbatch", type=int)
    # partitioning: "layers" (equal layer counts), "params" (balanced parameter counts) or
    # explicit boundaries: the first global layer index of every stage after the first.
    partition: str = _opt("layers", "cut the layers into stages of equal layer counts or of "
                          "balanced parameter counts", choices=("layers", "params"))
    boundaries: tuple[int, ...] | None = _opt(
        None, "explicit stage boundaries: first layer index of stages 1..S-1, comma separated",
        parse=_ints)
    # activation recomputation (torch.utils.checkpoint), as Megatron-LM's --recompute-granularity
    recompute: str = _opt("none", "activation recomputation: none, selective (core attention: "
                          "recomputed in the backward) or full (each transformer block keeps "
                          "only its input)", choices=RECOMPUTE)
    recompute_layers: int | None = _opt(
        None, "with --recompute full: recompute the first N transformer blocks of each stage "
        "(Megatron's --recompute-num-layers, block method; default: all)", type=int,
        metavar="N")


@dataclass(frozen=True)
class ModelConfig:
    """The built-in GPT's shape, and the data it trains on."""

    layers: int = _opt(2, "transformer blocks (plus embedding and head)", type=int)
    hidden: int = _opt(64, "model width (divisible by --heads)", type=int)
    heads: int = _opt(4, "attention heads", type=int)
    seq_len: int = _opt(32, "tokens per sequence", type=int)
    vocab: int = _opt(256, "vocabulary size (>= 256 for a text file)", type=int)
    ffn_mult: int = _opt(4, "MLP width as a multiple of --hidden", type=int)
    tie_embeddings: bool = _opt(False, "the LM head's weight is the token embedding "
                                "(Megatron-LM's default, GPT-2's); kept one parameter across "
                                "the first and last stage's ranks", action="store_true")
    data: str = _opt("synthetic", "'synthetic' or a text file (byte-level tokens)")
    # a Hugging Face model directory instead of the built-in GPT (pipeexec/models/hf.py)
    hf_model: str | None = _opt(
        None, "train a Hugging Face model instead of the built-in GPT: a directory holding "
        "config.json (llama, mistral, mixtral, qwen2 or gpt2; random init) and optionally "
        "*.safetensors (loaded); --layers, --hidden, --heads, --vocab and --tie-embeddings come "
        "from config.json",
        metavar="DIR")


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


@dataclass(frozen=True)
class PrecisionConfig:
    """Compute precision and fp16's dynamic loss scaling."""

    precision: str = _opt("fp32", "compute precision (bf16 / fp16 keep fp32 master weights)",
                          choices=PRECISIONS)
    loss_scale: float = _opt(2.0 ** 16, "initial dynamic loss scale (fp16)", type=float)
    loss_scale_growth_interval: int = _opt(
        1000, "fp16: double the loss scale after this many steps without overflow", type=int)
    loss_scale_backoff: float = _opt(0.5, "fp16: factor the loss scale shrinks by on overflow",
                                     type=float)
    loss_scale_growth: float = _opt(2.0, "fp16: factor the loss scale grows by", type=float)
    min_loss_scale: float = _opt(1.0, "fp16: the loss scale never goes below this", type=float)


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


SECTIONS: dict[str, type] = {"layout": LayoutConfig, "model": ModelConfig,
                             "optimizer": OptimizerConfig, "mixed_precision": PrecisionConfig,
                             "runtime": RuntimeConfig}
# field name -> the section holding it
_SECTION_OF = {f.name: name for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)}


@dataclass(frozen=True, init=False)
class TrainConfig:
    """Every knob of a run, by concern: ``layout``, ``model``, ``optimizer``,
    ``mixed_precision``, ``runtime`` (checkpointing and profiling are `CheckpointOptions` and
    `ProfileOptions`). Fields read flat (``config.pp``) and are given flat
    (``TrainConfig(pp=2, lr=3e-4)``) or as sections; the CLI is generated from the fields
    (`cli_fields`), so the two cannot drift."""

    layout: LayoutConfig
    model: ModelConfig
    optimizer: OptimizerConfig
    mixed_precision: PrecisionConfig
    runtime: RuntimeConfig

    def __init__(self, layout: LayoutConfig | None = None, model: ModelConfig | None = None,
                 optimizer: OptimizerConfig | None = None,
                 mixed_precision: PrecisionConfig | None = None,
                 runtime: RuntimeConfig | None = None, **flat: Any) -> None:
        given = {"layout": layout, "model": model, "optimizer": optimizer,
                 "mixed_precision": mixed_precision, "runtime": runtime}
        routed: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for key, value in flat.items():
            if key not in _SECTION_OF:
                raise TypeError(f"TrainConfig: unknown field {key!r}")
            routed[_SECTION_OF[key]][key] = value
        for name, cls in SECTIONS.items():
            section = given[name] if given[name] is not None else cls()
            if routed[name]:
                section = dataclasses.replace(section, **routed[name])
            object.__setattr__(self, name, section)

    def __getattr__(self, name: str) -> Any:
        section = _SECTION_OF.get(name)
        if section is None or section not in self.__dict__:
            raise AttributeError(f"TrainConfig has no field {name!r}")
        return getattr(self.__dict__[section], name)

    @staticmethod
    def field_names() -> tuple[str, ...]:
        """Every flat field, in section order."""
        return tuple(_SECTION_OF)

    @staticmethod
    def cli_fields() -> list[dataclasses.Field]:
        """The fields that have a command-line flag, in section order."""
        return [f for cls in SECTIONS.values() for f in flagged(cls)]

    @staticmethod
    def flag(name: str) -> str:
        """The command-line flag that sets field ``name`` (``name (no flag)`` when none)."""
        f = next((f for cls in SECTIONS.values() for f in dataclasses.fields(cls)
                  if f.name == name), None)
        if f is None:                   # a launcher option (--cpus-per-rank, --nproc...)
            return "--" + name.replace("_", "-")
        if f.metadata.get("flag") is None:
            return f"{name} (no flag)"
        return flag_of(f)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp

    @property
    def num_stages(self) -> int:
        return self.pp * self.vpp

    @property
    def global_batch(self) -> int:
        return self.dp * self.microbatches * self.micro_batch_size

    @property
    def num_layers(self) -> int:
        """Length of the built-in GPT's layer list: embedding, blocks, head."""
        return self.layers + 2

    def with_hf_model(self, path: str) -> "TrainConfig":
        """A copy training the Hugging Face model directory ``path``, its shape (layers,
        hidden, heads, vocab, tied embeddings) read from its config.json (raises ConfigError with the reason)."""
        from .models.hf_config import HFModelError, read_hf_config

        try:
            info = read_hf_config(path)
        except HFModelError as exc:
            raise ConfigError(str(exc)) from None
        return self.replace(hf_model=str(path), **info.train_fields())

    def replace(self, **changes: Any) -> "TrainConfig":
        """A copy with flat fields or whole sections changed."""
        sections = {name: changes.pop(name, getattr(self, name)) for name in SECTIONS}
        return TrainConfig(**sections, **changes)

    def to_dict(self) -> dict:
        """Flat: field -> value (what checkpoints and measured runs store)."""
        out: dict[str, Any] = {}
        for name in SECTIONS:
            out.update(dataclasses.asdict(getattr(self, name)))
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        """From `to_dict`'s flat form (lists back to tuples)."""
        values = dict(data)
        for k in ("boundaries", "inject"):
            if isinstance(values.get(k), list):
                values[k] = tuple(values[k])
        return cls(**values)

    def validate(self, world_size: int | None = None, num_layers: int | None = None, *,
                 check_schedule: bool = True) -> "TrainConfig":
        """Raise ConfigError naming the field; build the schedule to check it accepts the layout
        (``check_schedule=False`` when the caller brings its own Schedule)."""
        for name in ("pp", "vpp", "dp", "microbatches", "micro_batch_size", "layers", "hidden",
                     "heads", "seq_len", "vocab", "steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if world_size is not None and world_size != self.world_size:
            raise ConfigError(f"world size {world_size} != pp * dp = {self.pp} * {self.dp} = "
                              f"{self.world_size}")
        if self.hidden % self.heads:
            raise ConfigError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.partition not in PARTITIONS:
            raise ConfigError(f"partition must be one of {', '.join(PARTITIONS)}, got {self.partition!r}")
        n_layers = self.num_layers if num_layers is None else num_layers
        if n_layers < self.num_stages:
            raise ConfigError(f"the model has {n_layers} layers (embedding + {n_layers - 2} blocks + "
                              f"head) but pp * vpp = {self.num_stages} stages need at least one each")
        if self.boundaries is not None:
            from .partition import PartitionError, explicit
            try:
                explicit(self.boundaries, n_layers, self.num_stages)
            except PartitionError as exc:
                raise ConfigError(str(exc)) from None
        if self.recompute not in RECOMPUTE:
            raise ConfigError(f"recompute must be one of {', '.join(RECOMPUTE)}, got "
                              f"{self.recompute!r}")
        if self.recompute_layers is not None:
            if self.recompute != "full":
                raise ConfigError("--recompute-layers applies to --recompute full, got "
                                  f"--recompute {self.recompute}")
            if (not isinstance(self.recompute_layers, int) or isinstance(self.recompute_layers, bool)
                    or self.recompute_layers < 0):
                raise ConfigError(f"recompute_layers must be an integer >= 0, got "
                                  f"{self.recompute_layers!r}")
        if self.hf_model is not None:
            self._validate_hf_model()
        if self.data != "synthetic" and self.vocab < 256:
            raise ConfigError(f"a text file needs vocab >= 256 (byte-level tokens), got {self.vocab}")
        self._validate_optimisation()
        if self.data != "synthetic":
            import os
            if not os.path.isfile(self.data):
                raise ConfigError(f"data: file {self.data!r} does not exist ('synthetic' or a "
                                  "text file)")
            if os.path.getsize(self.data) < self.seq_len + 2:
                raise ConfigError(f"data: file {self.data!r} has {os.path.getsize(self.data)} "
                                  f"bytes, fewer than seq_len + 2 = {self.seq_len + 2}")
        if not isinstance(self.recv_lookahead, int) or self.recv_lookahead < 0:
            raise ConfigError(f"recv_lookahead must be a non-negative integer, got {self.recv_lookahead!r}")
        if not isinstance(self.nccl_matching, bool):
            raise ConfigError(f"nccl_matching must be true or false, got {self.nccl_matching!r}")
        if self.nccl_matching and (self.backend == "nccl" or
                                   (self.device or "").startswith("cuda")):
            raise ConfigError("nccl_matching emulates NCCL's matching on gloo (CPU); with "
                              f"backend={self.backend!r} device={self.device!r} it does not apply: "
                              "drop --nccl-matching, or run with --device cpu")
        if self.p2p_timeout <= 0 or self.collective_timeout <= 0:
            raise ConfigError("timeouts must be positive")
        if self.memory_limit is not None:
            if self.schedule != "zb-auto":
                raise ConfigError(f"memory_limit applies to the zb-auto schedule (a search under "
                                  f"it), got schedule {self.schedule!r}")
            if not self.memory_limit > 0:
                raise ConfigError(f"memory_limit must be > 0 bytes, got {self.memory_limit!r}")
            if self.vpp not in (1, 2) or self.forward_only:
                raise ConfigError(f"zb-auto with a memory_limit trains with vpp = 1 or 2 and a "
                                  f"backward, got vpp = {self.vpp}"
                                  + (" and forward_only" if self.forward_only else ""))
            if isinstance(self.reschedule_margin, bool) or not (
                    isinstance(self.reschedule_margin, (int, float))
                    and 0 <= self.reschedule_margin < 1):
                raise ConfigError(f"reschedule_margin must be a fraction in [0, 1) (0.05: 5%), "
                                  f"got {self.reschedule_margin!r}")
            if not isinstance(self.reschedule_after, int) or self.reschedule_after < 1:
                raise ConfigError(f"reschedule_after must be a positive integer, got "
                                  f"{self.reschedule_after!r}")
            if self.steps < self.reschedule_after + 2:
                raise ConfigError(f"steps = {self.steps}: zb-auto profiles steps 1.."
                                  f"{self.reschedule_after} (after a warm-up step) before it "
                                  f"searches, so it needs steps >= {self.reschedule_after + 2}")
        if self.placement is not None:
            if self.placement not in PLACEMENT_CHOICES:
                raise ConfigError(f"placement must be one of {', '.join(PLACEMENT_CHOICES)}, got "
                                  f"{self.placement!r}")
            if self.schedule != "zb-auto" or self.vpp != 2:
                raise ConfigError(f"placement chooses where zb-auto puts its stages at vpp = 2; "
                                  f"got schedule {self.schedule!r} with vpp = {self.vpp} (the "
                                  "other schedules fix their own placement)")
        if check_schedule:
            self.build_schedule()
        return self

    def _validate_hf_model(self) -> None:
        from .models.hf_config import HFModelError, check_hf_run, read_hf_config

        try:
            info = read_hf_config(self.hf_model)
            check_hf_run(info, seq_len=self.seq_len, **{
                name: getattr(self, name) for name in info.train_fields()})
        except HFModelError as exc:
            raise ConfigError(str(exc)) from None

    def _validate_optimisation(self) -> None:
        import math

        def number(name: str, *, low: float = 0.0, strict: bool = False, high: float | None = None,
                   hint: str = "") -> None:
            v = getattr(self, name)
            ok = (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                  and (v > low if strict else v >= low) and (high is None or v <= high))
            if not ok:
                bound = f"{'>' if strict else '>='} {low:g}" + (f" and <= {high:g}" if high is not None else "")
                raise ConfigError(f"{name} must be a finite number {bound}{hint}, got {v!r}")

        number("lr", hint=" (--lr)")
        number("min_lr", high=self.lr, hint=" and at most --lr (--min-lr)")
        number("weight_decay")
        number("clip_grad", hint=" (0: no clipping)")
        number("beta1", high=1.0 - 1e-12)
        number("beta2", high=1.0 - 1e-12)
        number("eps", strict=True)
        number("loss_scale", strict=True)
        number("min_loss_scale", strict=True)
        number("loss_scale_backoff", strict=True, high=1.0)
        number("loss_scale_growth", low=1.0)
        for name in ("warmup_steps", "loss_scale_growth_interval"):
            v = getattr(self, name)
            low = 1 if name == "loss_scale_growth_interval" else 0
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ConfigError(f"{name} must be an integer >= {low}, got {v!r}")
        if self.decay_steps is not None and (not isinstance(self.decay_steps, int)
                                             or self.decay_steps < 1):
            raise ConfigError(f"decay_steps must be a positive integer (or unset: --steps), got "
                              f"{self.decay_steps!r}")

    def build_schedule(self):
        """The pipesim Schedule of this run (raises pipesim.ScheduleError with the reason)."""
        import pipesim

        if self.schedule.endswith((".json", ".csv")):
            return self._schedule_from_file()
        options = {} if self.placement is None else {"placement": self.placement}
        schedule = pipesim.build_schedule(self.schedule, pp=self.pp, microbatches=self.microbatches,
                                          vpp=self.vpp, forward_only=self.forward_only,
                                          recv_lookahead=self.recv_lookahead, **options)
        return schedule.validate()

    def _schedule_from_file(self):
        """``schedule`` names a file (our JSON, torch's CSV): it must fit this run's layout."""
        import pipesim
        from pipesim.schedule.io import schedule_from_csv

        path = self.schedule
        s = (_schedule_json if path.endswith(".json") else schedule_from_csv)(path).validate()
        for name, want, got in (("pp", self.pp, s.pp), ("vpp", self.vpp, s.parts_per_rank),
                                ("microbatches", self.microbatches, s.num_microbatches)):
            if want != got:
                raise pipesim.ScheduleError(f"{path}: the schedule has {name} = {got}, the run "
                                            f"{name} = {want}; pass --{name} {got}")
        if self.forward_only:
            s = s.with_orders([[a for a in s.compute_parts(r) if a.op == "F"] for r in range(s.pp)],
                              name=f"{s.name} (forward only)", forward_only=True)
        if self.recv_lookahead and not s.has_explicit_comms:
            s = s.with_recv_lookahead(self.recv_lookahead)
        return s.validate()


def _schedule_json(path: str):
    """A schedule JSON file (pipesim.schedule.io), or a plan file (pipesim.Plan.to_json)
    holding its schedule as data."""
    import json

    import pipesim
    from pipesim.schedule.io import schedule_from_dict, schedule_from_json

    try:
        data = json.loads(open(path).read())
    except (OSError, json.JSONDecodeError):
        return schedule_from_json(path)          # its own error, naming the file
    if isinstance(data, dict) and str(data.get("format", "")).startswith("pipesim.plan"):
        if not isinstance(data.get("schedule"), dict):
            raise pipesim.ScheduleError(f"{path}: the plan names its schedule "
                                        f"({data.get('schedule')!r}) instead of holding it")
        return schedule_from_dict(data["schedule"], source=f"{path}: schedule")
    return schedule_from_dict(data, path)
