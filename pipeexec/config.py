"""`TrainConfig`: every knob of a run, as one plain value.

The CLI builds it, the launcher pickles it to the workers, a checkpoint stores it (``asdict``)
and compares it on load. Nothing reads configuration from module globals. ``validate`` checks
everything that can be checked without a process group, so a bad layout fails before any
collective with the reason.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

PRECISIONS = ("fp32", "bf16", "fp16")
PARTITIONS = ("layers", "params")


class ConfigError(ValueError):
    """A configuration that cannot run, with the field and the reason."""


@dataclass(frozen=True)
class TrainConfig:
    # pipeline layout
    schedule: str = "1f1b"
    pp: int = 1
    vpp: int = 1
    dp: int = 1
    microbatches: int = 1
    micro_batch_size: int = 1
    # zb-auto: profile `reschedule_after` steps of ZB-H1 (after a warm-up step), search a
    # schedule from the measured costs under `memory_limit` bytes per rank, switch to it
    memory_limit: float | None = None
    reschedule_after: int = 2
    # built-in GPT
    layers: int = 2            # transformer blocks; the layer list adds embedding and head
    hidden: int = 64
    heads: int = 4
    seq_len: int = 32
    vocab: int = 256
    ffn_mult: int = 4
    # partitioning: "layers" (equal layer counts), "params" (balanced parameter counts) or
    # explicit boundaries: the first global layer index of every stage after the first.
    partition: str = "layers"
    boundaries: tuple[int, ...] | None = None
    # data
    data: str = "synthetic"    # "synthetic" or a path to a text file (byte-level tokens)
    # optimisation
    steps: int = 1
    lr: float = 1e-3
    min_lr: float = 0.0
    warmup_steps: int = 0
    decay_steps: int | None = None   # cosine decay length; default: steps
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    clip_grad: float = 1.0           # 0 disables clipping
    # precision
    precision: str = "fp32"
    loss_scale: float = 2.0 ** 16    # initial dynamic scale (fp16 only)
    loss_scale_growth_interval: int = 1000
    loss_scale_backoff: float = 0.5
    loss_scale_growth: float = 2.0
    min_loss_scale: float = 1.0
    # runtime
    seed: int = 0
    forward_only: bool = False
    deallocate_outputs: bool = True
    recv_lookahead: int = 1          # post receives this many computations before their consumer
    cpu_keep_freed_memory: bool = True   # CPU: malloc keeps freed memory (pipeexec/malloc.py)
    p2p_timeout: float = 300.0       # seconds for one send/receive to complete
    # gloo emulating NCCL's point-to-point matching: tags ignored, a group's transfers between
    # two ranks matched in posting order (finds posting-order bugs on CPU; pipeexec/p2p.py)
    nccl_matching: bool = False
    collective_timeout: float = 600.0
    backend: str | None = None       # None: nccl when CUDA is available, else gloo
    device: str | None = None        # None: cuda when a GPU is visible, else cpu; cuda means
                                     # cuda:<local rank % visible GPUs> (pipeexec/devices.py)
    # fault injection, for tests of the failure paths (never set in normal runs):
    # "raise:RANK:STEP:ACTION" raises in that action, "exit:RANK:STEP:ACTION" kills the process
    # there (SIGKILL), "hang:RANK:STEP:ACTION" blocks there forever, "overflow:STEP" puts an inf into one gradient of the last stage at that step.
    inject: tuple[str, ...] = field(default_factory=tuple)

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

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

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
            if self.vpp != 1 or self.forward_only:
                raise ConfigError("zb-auto with a memory_limit trains with vpp = 1")
            if not isinstance(self.reschedule_after, int) or self.reschedule_after < 1:
                raise ConfigError(f"reschedule_after must be a positive integer, got "
                                  f"{self.reschedule_after!r}")
            if self.steps < self.reschedule_after + 2:
                raise ConfigError(f"steps = {self.steps}: zb-auto profiles steps 1.."
                                  f"{self.reschedule_after} (after a warm-up step) before it "
                                  f"searches, so it needs steps >= {self.reschedule_after + 2}")
        if check_schedule:
            self.build_schedule()
        return self

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
        schedule = pipesim.build_schedule(self.schedule, pp=self.pp, microbatches=self.microbatches,
                                          vpp=self.vpp, forward_only=self.forward_only,
                                          recv_lookahead=self.recv_lookahead)
        return schedule.validate()

    def _schedule_from_file(self):
        """``schedule`` names a file (our JSON, torch's CSV): it must fit this run's layout."""
        import pipesim
        from pipesim.schedule.io import schedule_from_csv, schedule_from_json

        path = self.schedule
        s = (schedule_from_json if path.endswith(".json") else schedule_from_csv)(path).validate()
        for name, want, got in (("pp", self.pp, s.pp), ("vpp", self.vpp, s.vpp),
                                ("microbatches", self.microbatches, s.num_microbatches)):
            if want != got:
                raise pipesim.ScheduleError(f"{path}: the schedule has {name} = {got}, the run "
                                            f"{name} = {want}; pass --{name} {got}")
        if self.forward_only:
            s = pipesim.Schedule(s.pp, s.vpp, s.num_microbatches, s.placement,
                                 [[a for a in s.compute_parts(r) if a.op == "F"] for r in range(s.pp)],
                                 name=f"{s.name} (forward only)", forward_only=True)
        if self.recv_lookahead and not s.has_explicit_comms:
            s = s.with_recv_lookahead(self.recv_lookahead)
        return s.validate()
