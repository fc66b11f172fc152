"""`CostModel`: what each action costs in seconds and bytes.

A cost is a scalar (the same for every stage) or a per-stage list (length ``num_stages``,
checked when a schedule is simulated, the error naming the field). Units are seconds and bytes
in both worlds, simulated and measured (DESIGN.md, principle 5), so a model fitted to a measured
trace with :func:`pipesim.sim.calibrate.fit_costs` predicts the same run back.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, Union

from ..fields import known_fields
from ..hardware import get_hardware

if TYPE_CHECKING:
    import pandas as pd

    from ..hardware import Hardware
    from .model import ModelSpec

PerStage = Union[float, Sequence[float]]
T = TypeVar("T")

_PER_STAGE = ("forward", "backward", "backward_input", "backward_weight", "p2p_bytes",
              "activation_bytes", "weight_grad_fraction", "stage_static_bytes", "grad_bytes",
              "optimizer", "unshard", "reduce_grad", "unshard_units", "reduce_grad_units")
# ZeRO as actions: written to JSON only when set, so a model without them saves as before
_SHARDING = {"unshard": 0.0, "reduce_grad": 0.0, "overlap_sharding": 1.0, "unshard_units": 1.0,
             "reduce_grad_units": 1.0, "overlap_reduce_grad": 1.0}
_SWITCHES = ("overlap_sharding", "overlap_reduce_grad")
_UNITS = ("unshard_units", "reduce_grad_units")


@dataclass(frozen=True)
class CostModel:
    """Costs of one microbatch on one stage, and of the links between ranks.

    Time (seconds): ``forward`` (F), ``backward`` (B, full backward), ``backward_input`` (I) and
    ``backward_weight`` (W). B defaults to I + W when both are given, else to twice F (the usual
    FLOP ratio); I and W default to an even split of B, or to B minus the other when one is given.

    Communication: a stage's output (forward) or input gradient (backward) of ``p2p_bytes`` takes
    ``p2p_latency + p2p_bytes / p2p_bandwidth`` seconds on the link between two ranks; zero cost
    by default.

    Memory (bytes): F adds ``activation_bytes`` (per microbatch per stage); B frees them; I frees
    all but the ``weight_grad_fraction`` share that W needs, and W frees that share (default
    0.5, a round guess; :meth:`transformer` derives it from the layer: the inputs of the four
    linear layers, ``14 sbh`` of ``sbh(34 + 5as/h)``).
    ``static_bytes`` is held by each rank for the whole step (scalar, or a list with one value per
    rank); ``stage_static_bytes`` (per stage: weights, gradients, optimizer state) is added to the
    rank that holds the stage.

    Overlapped forward and backward (an ``OVERLAP_F_B`` action, DualPipe's F&B): it takes
    ``overlap_factor`` times the sum of its parts' times (1.0, the default: no gain, the parts
    run one after the other, each once its own input is there, as pipeexec and torch's runtime
    run them; below 1.0 they run together, so the pair starts once both inputs are there; 0.5:
    perfect overlap of two equal parts), or, when ``overlap_factor`` is a function
    ``(parts, seconds) -> seconds`` of the two actions and their own times, what it returns
    (parts run together; such a model cannot be saved as JSON).

    Step tail (only with ``simulate(..., step_tail=True)``): data-parallel all-reduce of the
    rank's ``grad_bytes`` (per stage) over ``dp`` replicas, ring model
    ``2 (dp-1) dp_latency + 2 (dp-1)/dp * bytes / dp_bandwidth``, then ``optimizer`` seconds
    (per stage).

    ZeRO as actions (a schedule lowered with a sharding, :mod:`pipesim.schedule.sharding`):
    ``unshard`` seconds for one ``UNSHARD`` of a stage (the all-gather of its weights),
    ``reduce_grad`` for one ``REDUCE_GRAD`` (the reduce-scatter of its gradients); a
    ``RESHARD`` costs nothing. Each rank runs them on a communication lane of its own, one at a
    time, in its order (one lane, not one per kind: FSDP2's and Megatron's gathers and
    reductions share a communicator, which runs them in launch order; docs/DESIGN.md): with
    ``overlap_sharding`` 1.0 (the default) an UNSHARD starts as soon as the lane is free but
    not before the rank's previous computation started (prefetched
    one computation ahead: FSDP's and Megatron's), its computation waiting for it, and a
    REDUCE_GRAD leaves the rank going on; with 0.0 both block the rank (pipeexec on one
    stream). Zero by default: the actions then take no time. ``overlap_reduce_grad`` 0.0 makes
    the rank wait for each REDUCE_GRAD, still run on the lane: the end of every backward waits
    for its reduction (DeepSpeed's ZeRO-2 epilogue and FSDP's post-backward callback when they
    reduce every microbatch); 1.0 (the default), the step's end waits for it (Megatron's
    ``finalize_model_grads``).

    ``unshard_units`` / ``reduce_grad_units`` (per stage, >= 1; 1 by default: the stage at once,
    pipeexec's unit): the units a stage's collective is made of, gathered or reduced one after
    another, the size of the stage over the units each, with ``overlap_sharding`` 1.0 streamed
    with the computation they serve. FSDP and Megatron gather a layer at a time (the next while
    the current one computes), so an UNSHARD's computation starts once its first unit is
    gathered and ends no sooner than the last unit's share of it after the gather ends; they
    reduce each bucket as the backward makes its gradients, so a REDUCE_GRAD starts once the
    backward it follows has made its first unit's and ends no sooner than one unit's reduction
    after that backward (the last bucket, exposed).
    """

    forward: PerStage = 1.0
    backward: PerStage | None = None
    backward_input: PerStage | None = None
    backward_weight: PerStage | None = None
    p2p_latency: float = 0.0
    p2p_bandwidth: float = math.inf
    p2p_bytes: PerStage = 0.0
    activation_bytes: PerStage = 0.0
    weight_grad_fraction: PerStage = 0.5
    static_bytes: PerStage = 0.0
    stage_static_bytes: PerStage = 0.0
    grad_bytes: PerStage = 0.0
    optimizer: PerStage = 0.0
    dp_latency: float = 0.0
    dp_bandwidth: float = math.inf
    overlap_factor: float | Callable[..., float] = 1.0
    unshard: PerStage = 0.0
    reduce_grad: PerStage = 0.0
    overlap_sharding: float = 1.0
    overlap_reduce_grad: float = 1.0
    unshard_units: PerStage = 1.0
    reduce_grad_units: PerStage = 1.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if f.name == "overlap_factor":
                if not callable(value):
                    value = _number(f.name, value)
                    if value <= 0:
                        raise ValueError(f"CostModel.overlap_factor must be > 0, got {value}")
                    object.__setattr__(self, f.name, value)
                continue
            if isinstance(value, (list, tuple)):
                if f.name not in _PER_STAGE and f.name != "static_bytes":
                    raise ValueError(f"CostModel.{f.name} must be a number, got a list")
                if not value:
                    raise ValueError(f"CostModel.{f.name} is an empty list")
                if _plain_figures(f.name, value):
                    # the common case (a plan derives thousands of these): no element to
                    # convert, no value to refuse
                    object.__setattr__(self, f.name, tuple(value))
                    continue
                values = tuple(_number(f.name, v) for v in value)
                object.__setattr__(self, f.name, values)
            else:
                values = (_number(f.name, value),)
                object.__setattr__(self, f.name, values[0])
            for v in values:
                if v < 0:
                    raise ValueError(f"CostModel.{f.name} must be >= 0, got {v}")
                if f.name == "weight_grad_fraction" and v > 1:
                    raise ValueError(f"CostModel.weight_grad_fraction must be in [0, 1], got {v}")
                if f.name in ("p2p_bandwidth", "dp_bandwidth") and v == 0:
                    raise ValueError(f"CostModel.{f.name} must be > 0")
                if f.name in _SWITCHES and v not in (0.0, 1.0):
                    raise ValueError(f"CostModel.{f.name} must be 0 or 1, got {v}")
                if f.name in _UNITS and v < 1:
                    raise ValueError(f"CostModel.{f.name} must be >= 1 (a stage is one unit or "
                                     f"more), got {v}")

    # -- per-stage views ----------------------------------------------------------------------
    def stage_values(self, name: str, num_stages: int) -> list[float]:
        """``name`` as a list of ``num_stages`` floats; raise ValueError naming the field."""
        value = getattr(self, name)
        if value is None:
            raise ValueError(f"CostModel.{name} is not set")
        if isinstance(value, tuple):
            if len(value) != num_stages:
                raise ValueError(f"CostModel.{name} has {len(value)} per-stage values, expected "
                                 f"num_stages = {num_stages}")
            return list(value)
        return [float(value)] * num_stages

    def for_schedule(self, schedule) -> "CostModel":
        """These costs for ``schedule``'s stages: where stages are copies of model parts
        (DualPipe), a per-stage list given per part (one value per part) is spread onto every
        stage that computes the part, so that a copy costs, holds and sends what its part does;
        otherwise the costs as they are."""
        parts = schedule.stage_parts
        if parts is None:
            return self
        k = schedule.num_parts
        spread = {}
        for name in _PER_STAGE:
            value = getattr(self, name)
            if isinstance(value, tuple) and len(value) == k != len(parts):
                spread[name] = tuple(value[p] for p in parts)
        return replace(self, **spread) if spread else self

    def rank_static_bytes(self, pp: int) -> list[float]:
        """``static_bytes`` per rank (scalar or a list of length ``pp``)."""
        value = self.static_bytes
        if isinstance(value, tuple):
            if len(value) != pp:
                raise ValueError(f"CostModel.static_bytes has {len(value)} per-rank values, "
                                 f"expected pp = {pp}")
            return list(value)
        return [float(value)] * pp

    def check_shape(self, num_stages: int, pp: int) -> "CostModel":
        """Raise ValueError naming the first field whose list does not fit the schedule."""
        for name in _PER_STAGE:                  # a scalar fits any schedule
            value = getattr(self, name)
            if isinstance(value, tuple) and len(value) != num_stages:
                self.stage_values(name, num_stages)     # raises, naming the field
        if isinstance(self.static_bytes, tuple) and len(self.static_bytes) != pp:
            self.rank_static_bytes(pp)
        return self

    def compute_times(self, num_stages: int) -> dict[str, list[float]]:
        """Seconds of F, B, I and W per stage, with the defaults of the class docstring."""
        fwd = self.stage_values("forward", num_stages)
        b = None if self.backward is None else self.stage_values("backward", num_stages)
        i = None if self.backward_input is None else self.stage_values("backward_input", num_stages)
        w = None if self.backward_weight is None else self.stage_values("backward_weight", num_stages)
        if b is None:
            b = [x + y for x, y in zip(i, w)] if i is not None and w is not None else [2 * x for x in fwd]
        if i is None and w is None:
            i = [x / 2 for x in b]
            w = list(i)
        elif i is None:
            i = [max(x - y, 0.0) for x, y in zip(b, w)]
        elif w is None:
            w = [max(x - y, 0.0) for x, y in zip(b, i)]
        return {"F": fwd, "B": b, "I": i, "W": w}

    @property
    def overlaps_parts(self) -> bool:
        """Whether an OVERLAP_F_B's parts run at the same time (``overlap_factor`` other than
        1.0, or a function): the pair then starts once the inputs of both are there. At 1.0
        they run one after the other, each when its own input is there."""
        return callable(self.overlap_factor) or self.overlap_factor != 1.0

    def overlap_time(self, parts: Sequence[Any], seconds: Sequence[float]) -> float:
        """Seconds of an overlapped action whose ``parts`` take ``seconds`` each on their own."""
        factor = self.overlap_factor
        if callable(factor):
            value = factor(tuple(parts), tuple(seconds))
            if not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
                raise ValueError(f"CostModel.overlap_factor({', '.join(map(str, parts))}) returned "
                                 f"{value!r}; expected seconds >= 0")
            return float(value)
        return factor * float(sum(seconds))

    def transfer_time(self, nbytes: float) -> float:
        """Seconds for one point-to-point message of ``nbytes``."""
        return self.p2p_latency + (nbytes / self.p2p_bandwidth if nbytes else 0.0)

    def allreduce_time(self, nbytes: float, dp: int) -> float:
        """Ring all-reduce of ``nbytes`` over ``dp`` replicas (0 when dp == 1)."""
        if dp <= 1:
            return 0.0
        return 2 * (dp - 1) * self.dp_latency + 2 * (dp - 1) / dp * nbytes / self.dp_bandwidth

    def derived(self, make: Callable[..., T], *args: Hashable) -> T:
        """``make(self, *args)``, made on the first call and kept with these costs: what an
        interpreter reads from them on every run (the simulator's per-stage tables) then costs
        one lookup when the same costs are simulated again (sweeps over schedules, zb-auto,
        benchmarks). ``make`` must be a pure function of the costs and ``args`` returning an
        immutable value; it may raise, and nothing is kept then. Not part of the value: not
        compared, copied or pickled."""
        memo = self.__dict__.get("_derived")
        if memo is None:
            memo = {}
            object.__setattr__(self, "_derived", memo)
        key = (make, args)
        value = memo.get(key)
        if value is None:
            value = memo[key] = make(self, *args)
        return value

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_derived", None)
        return state

    def with_(self, **changes: Any) -> "CostModel":
        """A copy with some fields changed."""
        return replace(self, **changes)

    # -- constructors --------------------------------------------------------------------------
    @classmethod
    def uniform(cls, forward: float = 1.0, backward: float | None = None,
                backward_input: float | None = None, backward_weight: float | None = None,
                activation_bytes: float = 1.0, **kwargs: Any) -> "CostModel":
        """The same scalar costs on every stage; activations count 1 byte per microbatch by
        default, so memory reads as microbatches held. For teaching and tests."""
        for name, value in (("forward", forward), ("backward", backward),
                            ("backward_input", backward_input), ("backward_weight", backward_weight)):
            if isinstance(value, (list, tuple)):
                raise ValueError(f"CostModel.uniform: {name} must be a scalar")
        return cls(forward=forward, backward=backward, backward_input=backward_input,
                   backward_weight=backward_weight, activation_bytes=activation_bytes, **kwargs)

    @classmethod
    def transformer(cls, model: "str | ModelSpec", hardware: "str | Hardware" = "H100", *,
                    num_stages: int, micro_batch_size: int = 1, efficiency: float = 0.5,
                    link: str = "inter", dp_link: str = "inter", dtype_bytes: int = 2
                    ) -> "CostModel":
        """Costs of a GPT-style decoder (formulas and citations in :mod:`pipesim.plan.transformer`).

        ``model`` and ``hardware`` are presets (``pipesim.plan.model_names()``,
        ``pipesim.hardware.hardware_names()``) or spec objects. Time = FLOPs / (peak bf16 FLOP/s
        * ``efficiency``). ``link`` chooses the pipeline p2p link ("intra": NVLink, "inter":
        the network), ``dp_link`` the data-parallel one.
        """
        # lazy: pipesim.plan's __init__ imports the plans, which import this module
        from .model import get_model
        from .transformer import stage_counts

        spec, hw = get_model(model), get_hardware(hardware)
        if not 0 < efficiency <= 1:
            raise ValueError(f"efficiency must be in (0, 1], got {efficiency}")
        c = stage_counts(spec, num_stages, micro_batch_size, dtype_bytes)
        rate = hw.peak_flops * efficiency

        def bw(kind: str, field: str) -> tuple[float, float]:
            if kind == "intra":
                return hw.link_latency, hw.link_bandwidth
            if kind == "inter":
                return hw.network_latency, hw.network_bandwidth
            raise ValueError(f"{field} must be 'intra' or 'inter', got {kind!r}")

        p2p_lat, p2p_bw = bw(link, "link")
        dp_lat, dp_bw = bw(dp_link, "dp_link")
        i = [x / rate for x in c.input_grad_flops]
        w = [x / rate for x in c.weight_grad_flops]
        return cls(
            forward=[x / rate for x in c.forward_flops],
            backward=[x + y for x, y in zip(i, w)], backward_input=i, backward_weight=w,
            p2p_latency=p2p_lat, p2p_bandwidth=p2p_bw, p2p_bytes=c.boundary_bytes,
            activation_bytes=c.activation_bytes,
            weight_grad_fraction=[wa / act for wa, act in zip(c.weight_grad_bytes, c.activation_bytes)],
            stage_static_bytes=[16 * p for p in c.params],
            grad_bytes=[dtype_bytes * p for p in c.params],
            optimizer=[28 * p / hw.hbm_bandwidth for p in c.params],
            dp_latency=dp_lat, dp_bandwidth=dp_bw,
        )

    # -- JSON ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values; infinity is written as the string "inf"."""
        out: dict[str, Any] = {}
        if callable(self.overlap_factor):
            raise ValueError("CostModel.overlap_factor is a function, which JSON cannot hold; "
                             "use a number to save the model")
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, tuple):
                value = [_encode(v) for v in value]
            elif value is not None:
                value = _encode(value)
            if f.name in _SHARDING and value == _SHARDING[f.name]:
                continue
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "dict") -> "CostModel":
        return cls(**known_fields(cls, data, "CostModel", source))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON: {exc}") from None
        return cls.from_dict(data, source=str(path))


def _plain_figures(field: str, values: Sequence[Any]) -> bool:
    """Whether every one of ``values`` is a float already (which `_number` returns as it is)
    that the field's rules below take (not NaN, >= 0, a weight-gradient fraction <= 1, units
    >= 1): then there is nothing to convert or refuse. Otherwise the rules' loop runs and names
    the value."""
    if not all(type(v) is float for v in values) or any(v != v for v in values):
        return False
    return (min(values) >= (1 if field in _UNITS else 0)
            and (field != "weight_grad_fraction" or max(values) <= 1))


def _number(field: str, value: Any) -> float:
    if isinstance(value, str) and value.strip().lower() in ("inf", "infinity"):
        return math.inf
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"CostModel.{field} must be a number, got {value!r}")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"CostModel.{field} is NaN")
    return value


def _encode(value: float) -> float | str:
    return "inf" if value == math.inf else value
