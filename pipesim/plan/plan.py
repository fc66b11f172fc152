"""`Plan`: everything one training step depends on, as one value.

``Plan(model, parallelism, cluster, schedule, ...)``: a :class:`ModelSpec`, a
:class:`Parallelism`, a :class:`Cluster`, a schedule (a registered name with its options, or a
:class:`pipesim.Schedule` value) and the stage partition. Torch-free, frozen, JSON round trip
(:meth:`to_json` / :meth:`from_json`), a one-line repr. :meth:`validate` refuses what cannot run
with a :class:`pipesim.PlanError` naming the field and the rule; not fitting in memory is not an
error but part of :func:`pipesim.simulate`'s report. :meth:`costs` derives the per-stage
:class:`pipesim.CostModel` the simulator reads (see :mod:`pipesim.plan.derive`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import PlanError, ScheduleError
from ..fields import json_value, typed_fields
from ..hardware import Hardware, get_hardware
from ..schedule.io import schedule_from_dict, schedule_to_dict
from ..schedule.registry import build_schedule, schedule_refusal
from ..schedule.schedule import Schedule
from ..units import format_count
from .cluster import Cluster
from .derive import PlanCosts, derive as derive_costs
from .model import ModelSpec, get_model
from .parallelism import Parallelism
from .partition import parse_layout, stage_layers

if TYPE_CHECKING:
    from .costs import CostModel

PLAN_FORMAT = "pipesim.plan/1"


@dataclass(frozen=True)
class Plan:
    model: ModelSpec
    parallelism: Parallelism = Parallelism()
    cluster: Cluster = Cluster(get_hardware("H100"))
    schedule: "str | Schedule" = "1f1b"
    schedule_options: tuple = ()                 # (name, value) pairs for build_schedule
    partition: tuple | None = None               # explicit layers per stage
    partition_layout: str | None = None          # Megatron's --pipeline-model-parallel-layout
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    account_for_embedding: bool = False
    account_for_loss: bool = False
    efficiency: float | None = None              # constant achieved/peak; None: the model's

    def __post_init__(self) -> None:
        if isinstance(self.model, (str, Path)):
            object.__setattr__(self, "model", get_model(self.model))
        if isinstance(self.schedule_options, dict):
            object.__setattr__(self, "schedule_options", tuple(sorted(self.schedule_options.items())))
        if self.partition is not None:
            object.__setattr__(self, "partition", tuple(self.partition))
        if self.efficiency is not None and not 0 < self.efficiency <= 1:
            raise PlanError(f"plan.efficiency: must be in (0, 1], got {self.efficiency!r}")

    # -- constructors --------------------------------------------------------------------------
    @classmethod
    def create(cls, model: "str | ModelSpec", hardware: "str | Hardware" = "H100", *,
               schedule: "str | Schedule" = "1f1b", gpus_per_node: int = 8,
               **kwargs: Any) -> "Plan":
        """Keyword arguments go to Parallelism, Cluster or Plan by name:
        ``Plan.create("llama3-70b", "H100", tp=8, pp=4, dp=8, sequence_parallel=True)``."""
        par_names = {f.name for f in fields(Parallelism)}
        clu_names = {f.name for f in fields(Cluster)} - {"hardware", "gpus_per_node"}
        plan_names = {f.name for f in fields(cls)} - {"model", "parallelism", "cluster", "schedule"}
        par = {k: v for k, v in kwargs.items() if k in par_names}
        clu = {k: v for k, v in kwargs.items() if k in clu_names}
        rest = {k: v for k, v in kwargs.items() if k in plan_names}
        unknown = sorted(set(kwargs) - par_names - clu_names - plan_names)
        if unknown:
            raise PlanError(f"Plan.create: unknown field(s) {', '.join(unknown)}")
        return cls(get_model(model), Parallelism(**par),
                   Cluster(get_hardware(hardware), gpus_per_node=gpus_per_node, **clu),
                   schedule, **rest)

    def with_(self, **changes: Any) -> "Plan":
        """A copy with Plan, Parallelism or Cluster fields changed (by name)."""
        par_names = {f.name for f in fields(Parallelism)}
        clu_names = {f.name for f in fields(Cluster)}
        par = {k: changes.pop(k) for k in list(changes) if k in par_names}
        clu = {k: changes.pop(k) for k in list(changes) if k in clu_names}
        if par:
            changes["parallelism"] = self.parallelism.with_(**par)
        if clu:
            changes["cluster"] = self.cluster.with_(**clu)
        return replace(self, **changes)

    # -- derived -------------------------------------------------------------------------------
    @property
    def microbatches(self) -> int:
        return self.parallelism.microbatches

    @property
    def world_size(self) -> int:
        return self.parallelism.world_size

    @property
    def schedule_name(self) -> str:
        return self.schedule.name if isinstance(self.schedule, Schedule) else str(self.schedule)

    def stage_layers(self) -> list[int]:
        if self.partition_layout is not None:
            if self.partition is not None:
                raise PlanError("partition_layout: give a layout or an explicit partition, not both")
            return parse_layout(self.partition_layout, self.model.layers,
                                self.parallelism.num_stages, self.model.mtp_layers)
        return stage_layers(self.model.layers, self.parallelism.num_stages,
                            explicit=self.partition, first=self.first_stage_layers,
                            last=self.last_stage_layers,
                            account_for_embedding=self.account_for_embedding,
                            account_for_loss=self.account_for_loss)

    def build_schedule(self) -> Schedule:
        """The schedule this plan runs, lowered with its ZeRO actions (`Parallelism.sharding`:
        the program the executor runs and the simulator times; a Schedule value's own sharding
        gives way to the plan's); PlanError naming the schedule's broken constraint."""
        par = self.parallelism
        if isinstance(self.schedule, Schedule):
            why = schedule_refusal(self.schedule, par.pp, par.vpp, par.microbatches,
                                   asked="the plan")
            if why is not None:
                raise PlanError(f"schedule: {why}")
            return self.schedule.with_sharding(par.sharding)
        try:
            return build_schedule(self.schedule, pp=par.pp, microbatches=par.microbatches,
                                  vpp=par.vpp, **dict(self.schedule_options)
                                  ).with_sharding(par.sharding)
        except ScheduleError as exc:
            raise PlanError(f"schedule: {exc}") from None
        except TypeError as exc:
            raise PlanError(f"schedule_options: {exc}") from None

    def validate(self) -> "Plan":
        """Raise PlanError naming the field and the rule; return self when the plan can run."""
        m, par = self.model, self.parallelism
        rules = [
            (m.heads % par.tp == 0, "parallelism.tp",
             f"attention heads ({m.heads}) must be divisible by tp ({par.tp})"),
            (m.num_kv_heads % par.tp == 0, "parallelism.tp",
             f"key/value heads ({m.num_kv_heads}) must be divisible by tp ({par.tp}) "
             "(Megatron: num_query_groups % tp == 0)"),
            (par.ep == 1 or m.is_moe, "parallelism.ep",
             f"ep={par.ep} needs an MoE model; {m.name} is dense"),
            (not m.is_moe or m.experts % par.ep == 0, "parallelism.ep",
             f"experts ({m.experts}) must be divisible by ep ({par.ep})"),
            ((par.dp * par.cp) % par.ep == 0, "parallelism.ep",
             f"ep ({par.ep}) must divide dp * cp ({par.dp * par.cp}): expert-parallel ranks are "
             "taken from the data- and context-parallel ranks"),
            (par.gbs % (par.micro_batch_size * par.dp) == 0, "parallelism.global_batch_size",
             f"global batch {par.gbs} must be divisible by micro_batch_size * dp = "
             f"{par.micro_batch_size} * {par.dp}"),
            (par.cp == 1 or m.seq_length % (2 * par.cp) == 0, "parallelism.cp",
             f"sequence length {m.seq_length} must be divisible by 2 * cp = {2 * par.cp} "
             "(load-balanced causal chunks)"),
            (not self.cluster.hardware.precision_refusal(par.precision), "parallelism.precision",
             self.cluster.hardware.precision_refusal(par.precision)),
            (not par.sequence_parallel or m.seq_length % par.tp == 0 or par.tp == 1,
             "parallelism.sequence_parallel",
             f"sequence length {m.seq_length} must be divisible by tp ({par.tp})"),
        ]
        for ok, field, rule in rules:
            if not ok:
                raise PlanError(f"{field}: {rule}")
        gpus = self.cluster.gpus_per_node
        if par.world_size > gpus and par.world_size % gpus:
            raise PlanError(f"cluster.gpus_per_node: world size tp*cp*pp*dp = {par.world_size} "
                            f"is not a whole number of {gpus}-GPU nodes")
        layers = self.stage_layers()
        if par.recompute_layers is not None and par.recompute_layers > max(layers):
            raise PlanError(f"parallelism.recompute_layers: {par.recompute_layers} exceeds the "
                            f"largest stage's {max(layers)} layers")
        self.build_schedule().validate()
        return self

    def costs(self) -> "CostModel":
        """The per-stage CostModel (pure and cheap; see :mod:`pipesim.plan.derive`)."""
        return self.derive().costs

    def derive(self) -> "PlanCosts":
        """Costs with their parts: FLOPs, links, memory per stage and rank, the step tail."""
        return derive_costs(self)

    # -- JSON ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        if isinstance(self.schedule, Schedule):
            schedule: Any = schedule_to_dict(self.schedule)
        else:
            schedule = self.schedule
        return {
            "format": PLAN_FORMAT,
            "model": self.model.to_dict(),
            "parallelism": self.parallelism.to_dict(),
            "cluster": self.cluster.to_dict(),
            "schedule": schedule,
            "schedule_options": dict(self.schedule_options),
            "partition": None if self.partition is None else list(self.partition),
            "partition_layout": self.partition_layout,
            "first_stage_layers": self.first_stage_layers,
            "last_stage_layers": self.last_stage_layers,
            "account_for_embedding": self.account_for_embedding,
            "account_for_loss": self.account_for_loss,
            "efficiency": self.efficiency,
        }

    @classmethod
    def from_dict(cls, data: dict, source: str = "plan") -> "Plan":
        if not isinstance(data, dict):
            raise PlanError(f"{source}: a plan is a JSON object, got {type(data).__name__}")
        data = dict(data)
        fmt = data.pop("format", PLAN_FORMAT)
        if fmt != PLAN_FORMAT:
            raise PlanError(f"{source}: format {fmt!r} is not {PLAN_FORMAT!r}")
        typed_fields(cls, data, "plan", source, PlanError, kinds={"schedule_options": "object"})
        for i, n in enumerate(data.get("partition") or ()):
            json_value(n, "int", f"plan.partition[{i}]", source, PlanError, low=0)
        if "model" not in data:
            raise PlanError(f"{source}: a plan needs a 'model'")
        model = data.pop("model")
        model = ModelSpec.from_dict(model, f"{source}: model") if isinstance(model, dict) else get_model(model)
        par = Parallelism.from_dict(data.pop("parallelism", {}), f"{source}: parallelism")
        clu = data.pop("cluster", None)
        cluster = Cluster.from_dict(clu, f"{source}: cluster") if clu is not None else cls.cluster
        schedule = data.pop("schedule", "1f1b")
        if isinstance(schedule, dict):
            schedule = schedule_from_dict(schedule, source=f"{source}: schedule")
        return cls(model, par, cluster, schedule, **data)

    def to_json(self, path: "str | Path | None" = None) -> str:
        text = json.dumps(self.to_dict(), indent=2) + "\n"
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, source: "str | Path") -> "Plan":
        """A plan from a JSON string or a file path."""
        text, name = str(source), "plan"
        if not text.lstrip().startswith("{"):
            path = Path(source)
            try:
                raw = path.read_bytes()
            except FileNotFoundError:
                raise PlanError(f"plan: no such file {str(path)!r}") from None
            except OSError as exc:
                raise PlanError(f"{path}: cannot read the plan file ({exc.strerror or exc})") from None
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise PlanError(f"{path}: not a plan file: byte {exc.start} is {raw[exc.start]:#04x}, "
                                "not UTF-8 text (a plan is JSON: pipesim simulate --save-plan "
                                "writes one)") from None
            name = str(path)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"{name}: not valid JSON: {exc}") from None
        return cls.from_dict(data, source=name)

    def __repr__(self) -> str:
        m, c = self.model, self.cluster
        return (f"Plan({m.name} {format_count(m.num_params())} seq={m.seq_length} on "
                f"{self.world_size} x {c.hardware.name} ({c.gpus_per_node}/node): "
                f"{self.parallelism.short()}, schedule={self.schedule_name})")
