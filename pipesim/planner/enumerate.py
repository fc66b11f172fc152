"""Every valid plan of a cluster: divisors of the world size, the model's and schedules' rules.

A :class:`SearchSpace` names the model, the GPUs, the global batch and the knobs to try; each
knob is a tuple of values (defaults below). :func:`enumerate_plans` walks the product
``tp x cp x pp x dp x ep x vpp/schedule x mbs x recompute x zero x ep_dispatcher`` with
``tp * cp * pp * dp``
equal to the GPU count and returns the plans that :meth:`pipesim.Plan.validate` would accept,
checked with cheap arithmetic (no schedule is built here), and counts the refused combinations
by reason. Rules, as Megatron-LM applies them:

* tp divides the attention and key/value heads and, unless ``tp_across_nodes``, stays inside
  one NVLink domain (its collectives sit on the critical path of every layer; cp's ring
  attention overlaps its transfers with the attention and may cross the network, as the cost
  model prices it);
* layers divide evenly over ``pp * vpp`` stages, or, with ``uneven`` (the default), pipesim's
  near-even split where they do not (Megatron's ``--decoder-first/last-pipeline-num-layers``:
  126 layers of Llama 3 405B over a power-of-two pp);
* ``m = gbs / (mbs * dp)`` is a whole number; ep (MoE only) divides the experts and ``dp * cp``;
* the expert-parallel dispatcher (alltoall, deepep, hybridep: Megatron's
  ``--moe-token-dispatcher-type`` / ``--moe-flex-dispatcher-backend``) is searched only where it
  moves tokens, a MoE model at ep > 1, over those the hardware runs by default
  (`Hardware.ep_dispatchers`: HybridEP on NVL72 racks, DeepEP and HybridEP on HGX H100 / B200);
  a dense model and ep 1 enumerate the default (alltoall) alone (Megatron's flex dispatcher
  needs tp x ep > 1; with ep 1 nothing crosses the expert group);
* cp splits the sequence into ``2 * cp`` load-balanced chunks;
* schedules: gpipe, 1f1b, zb-h1, zb-h2 and dualpipe (pp model parts, each rank holding a
  second copy) run vpp = 1; zbv, dualpipev, v-half and v-min vpp = 2; interleaved and
  looped-bfs vpp > 1 (vpp = 1 is 1f1b / gpipe), interleaved with ``m % pp == 0`` (its default
  microbatch group of pp); every builder's own constraints hold (e.g. dualpipev's
  ``m >= 2 pp``; a combination its builder refuses is counted under its name); with pp = 1
  there is no pipeline, and the first vpp = 1 schedule asked for stands for all of them;
  zb-auto is not enumerated (its order is searched from one plan's costs under that plan's
  memory: search the others, then run zb-auto on the chosen plan);
* sequence parallelism is on whenever tp > 1 (it only saves memory and sends less);
* selective recomputation is searched only without ``none``: with flash attention (the plans'
  default) it recomputes nothing and keeps what ``none`` keeps, the same plan twice.
"""
from __future__ import annotations

from collections import Counter
from functools import lru_cache
from dataclasses import dataclass, field
from typing import Iterator

from ..errors import PlanError
from ..hardware import Hardware, get_hardware
from ..plan.cluster import Cluster
from ..plan.model import ModelSpec, get_model
from ..plan.parallelism import (CP_COMM, DEFAULT_EP_DISPATCHER, EP_DISPATCHERS, RECOMPUTE,
                                 Parallelism)
from ..plan.plan import Plan
from ..schedule.registry import schedule_info, schedule_names, schedule_refusal

ALL_SCHEDULES = ("gpipe", "1f1b", "interleaved", "looped-bfs", "zb-h1", "zb-h2", "zbv",
                 "dualpipev", "v-half", "v-min", "dualpipe")
# each schedule's vpp as its builder registers it (`BuilderInfo.searched_vpp`): 1 (dualpipe:
# pp model parts, a copy of another on each rank), 2 (the V schedules), or the space's values
VPP_MANY = tuple(s for s in ALL_SCHEDULES if schedule_info(s).searched_vpp is None)
DEFAULT_VPPS = tuple(range(2, 9))           # the vpp values searched unless --vpp is given
_NOT_ENUMERATED = {"zb-auto": "zb-auto's order is searched from one plan's costs under that "
                   "plan's memory, so the planner does not enumerate it: search the handcrafted "
                   "schedules, then run zb-auto on the chosen plan (pipesim simulate zb-auto "
                   "--plan plan.json --memory-limit ...)"}


@lru_cache(maxsize=4096)
def _refusal(schedule: str, pp: int, vpp: int, m: int) -> str | None:
    """Why ``schedule``'s builder refuses (pp, vpp, m), as a count key; None when it builds.
    Asks the builder's registered check: nothing is built."""
    if schedule_refusal(schedule, pp, vpp, m) is None:
        return None
    return f"{schedule}: its constraints ({schedule_info(schedule).constraints})"


def _powers_of_two(limit: int) -> tuple[int, ...]:
    out, x = [], 1
    while x <= limit:
        out.append(x)
        x *= 2
    return tuple(out)


@dataclass(frozen=True)
class SearchSpace:
    """What to search: a model on ``gpus`` GPUs at global batch ``gbs``, and the knobs' values.

    ``None`` for a knob means its default: tp powers of two up to the NVLink domain; cp 1, 2, 4;
    pp every divisor of the GPU count; vpp 2..8 for the interleaved schedules; mbs 1, 2, 4;
    recompute none / selective / full; zero 0 to 3 (Megatron's distributed optimizer is 1, FSDP
    2 and 3); ep every divisor of the experts (MoE models); ep_dispatcher the dispatchers the
    hardware runs (`Hardware.ep_dispatchers`; tried for MoE plans at ep > 1 only); uneven
    stages where layers do not divide (``uneven=False``: Megatron's even split only).
    """

    model: ModelSpec
    gpus: int
    gbs: int
    hardware: Hardware = field(default_factory=lambda: get_hardware("H100"))
    gpus_per_node: int = 8
    seq_length: int | None = None
    schedules: tuple[str, ...] = ALL_SCHEDULES
    tp: tuple[int, ...] | None = None
    cp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    vpp: tuple[int, ...] | None = None
    ep: tuple[int, ...] | None = None
    mbs: tuple[int, ...] = (1, 2, 4)
    recompute: tuple[str, ...] = RECOMPUTE
    zero: tuple[int, ...] = (0, 1, 2, 3)
    ep_dispatcher: tuple[str, ...] | None = None
    precision: str = "bf16"
    cp_comm: str = "p2p"         # how cp exchanges K/V (Parallelism.cp_comm; pipeexec: all_gather)
    overlap_tp_comm: bool = False   # Megatron's --tp-comm-overlap (Parallelism.overlap_tp_comm)
    # Megatron's --overlap-moe-expert-parallel-comm (Parallelism.overlap_ep_comm), on the MoE
    # plans at ep > 1 (nothing to hide elsewhere: their keys stay as without it)
    overlap_ep_comm: bool = False
    grad_reduce: str = "per_step"       # ZeRO-2/3's gradient reduction (Parallelism.grad_reduce)
    grad_reduce_in_fp32: bool | None = None     # (Parallelism.grad_reduce_in_fp32)
    # filters and fixed values: dp (derived from the other sizes) and microbatches (from the
    # global batch) kept only where listed; sequence parallelism None: on wherever tp > 1;
    # recompute_layers: Megatron's --recompute-num-layers for the full-recomputation plans
    dp: tuple[int, ...] | None = None
    microbatches: tuple[int, ...] | None = None
    sequence_parallel: bool | None = None
    recompute_layers: int | None = None
    tp_across_nodes: bool = False
    uneven: bool = True
    efficiency: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.model, str):
            object.__setattr__(self, "model", get_model(self.model))
        if isinstance(self.hardware, str):
            object.__setattr__(self, "hardware", get_hardware(self.hardware))
        if self.seq_length is not None and self.seq_length != self.model.seq_length:
            object.__setattr__(self, "model", self.model.with_(seq_length=self.seq_length))
        for name in ("gpus", "gbs", "gpus_per_node"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"search space: {name} must be a positive integer, got {v!r}")
        known = schedule_names()
        for s in self.schedules:
            if s in _NOT_ENUMERATED:
                raise ValueError(f"search space: {_NOT_ENUMERATED[s]}")
            if s not in known:
                raise ValueError(f"search space: unknown schedule {s!r}; known: {', '.join(known)}")
        if not self.schedules:
            raise ValueError("search space: no schedule to search")
        for name in ("tp", "cp", "pp", "vpp", "ep", "mbs", "zero", "dp", "microbatches"):
            values = getattr(self, name)
            if values is not None:
                values = tuple(sorted(set(values)))
                object.__setattr__(self, name, values)
                if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "zero" else 1)
                                     for v in values):
                    raise ValueError(f"search space: {name} values must be positive integers, "
                                     f"got {values!r}")
        bad = [r for r in self.recompute if r not in RECOMPUTE]
        if bad or not self.recompute:
            raise ValueError(f"search space: recompute values must be none, selective or full, "
                             f"got {self.recompute!r}")
        if self.cp_comm not in CP_COMM:
            raise ValueError(f"search space: cp_comm must be one of {', '.join(CP_COMM)}, got "
                             f"{self.cp_comm!r}")
        if self.ep_dispatcher is not None:
            self._check_dispatchers()
        if any(z not in (0, 1, 2, 3) for z in self.zero):
            raise ValueError(f"search space: zero values must be 0..3, got {self.zero!r}")
        try:            # (Parallelism's own checks of the gradient-reduction fields)
            Parallelism(precision=self.precision, grad_reduce=self.grad_reduce,
                        grad_reduce_in_fp32=self.grad_reduce_in_fp32)
        except PlanError as exc:
            raise ValueError(f"search space: {exc}") from None

    def _check_dispatchers(self) -> None:
        given = self.ep_dispatcher
        given = (given,) if isinstance(given, str) else tuple(dict.fromkeys(given))
        bad = [d for d in given if d not in EP_DISPATCHERS]
        if bad or not given:
            raise ValueError(f"search space: ep_dispatcher (--ep-dispatcher) values must be "
                             f"among {', '.join(EP_DISPATCHERS)}, got {list(given)!r}")
        runs = self.hardware.ep_dispatchers
        missing = [d for d in given if d not in runs]
        if missing:
            why = self.hardware.source("ep_dispatchers")
            raise ValueError(f"search space: ep_dispatcher {', '.join(missing)} does not run on "
                             f"{self.hardware.name}, which runs {', '.join(runs)}"
                             + (f" ({why})" if why else "")
                             + ": choose among those, or give a hardware file whose "
                             "ep_dispatchers lists it")
        object.__setattr__(self, "ep_dispatcher", tuple(d for d in EP_DISPATCHERS if d in given))

    @property
    def cluster(self) -> Cluster:
        return Cluster(self.hardware, gpus_per_node=self.gpus_per_node)

    def values(self, knob: str) -> tuple:
        """The values tried for ``knob`` (defaults filled in)."""
        given = getattr(self, knob)
        if given is not None:
            return given
        domain = self.cluster.domain
        if knob == "tp":
            return _powers_of_two(self.gpus if self.tp_across_nodes else min(domain, self.gpus))
        if knob == "cp":
            return (1, 2, 4)
        if knob == "pp":
            return tuple(d for d in range(1, self.gpus + 1) if self.gpus % d == 0)
        if knob == "vpp":
            return DEFAULT_VPPS
        if knob == "ep":
            e = self.model.experts
            return tuple(d for d in range(1, e + 1) if e % d == 0) if e else (1,)
        if knob == "ep_dispatcher":
            return self.hardware.ep_dispatchers
        raise KeyError(knob)

    def dispatchers(self, ep: int) -> tuple[str, ...]:
        """The dispatchers tried at ``ep``: the space's for a MoE model at ep > 1, else the
        default alone (nothing to dispatch: no plan is tried twice)."""
        if self.model.is_moe and ep > 1:
            return self.values("ep_dispatcher")
        return (DEFAULT_EP_DISPATCHER,)


@dataclass(frozen=True)
class Enumeration:
    """The valid plans (in a deterministic order) and the refused combinations by reason."""

    plans: list[Plan]
    refused: Counter

    def __len__(self) -> int:
        return len(self.plans)

    def refused_text(self) -> str:
        return "\n".join(f"{n:>8}  {reason}" for reason, n in self.refused.most_common())


def plan_key(plan: Plan) -> str:
    """A short unique name of a searched plan (its knobs), used to order ties and to look up."""
    p = plan.parallelism
    ep = f"ep{p.ep}" + ("" if p.ep_dispatcher == DEFAULT_EP_DISPATCHER
                        else f"({p.ep_dispatcher})")
    return (f"{plan.schedule_name} tp{p.tp} cp{p.cp} pp{p.pp} vpp{p.vpp} dp{p.dp} {ep} "
            f"mbs{p.micro_batch_size} {p.recompute} z{p.zero}")


def enumerate_plans(space: SearchSpace) -> Enumeration:
    refused: Counter = Counter()
    plans = list(_walk(space, refused))
    return Enumeration(plans, refused)


def _walk(space: SearchSpace, refused: Counter) -> Iterator[Plan]:
    model, n, gbs = space.model, space.gpus, space.gbs
    domain = space.cluster.domain
    gpn = space.gpus_per_node
    if n > gpn and n % gpn:
        refused[f"{n} GPUs are not a whole number of {gpn}-GPU nodes"] += 1
        return
    if space.hardware.precision_refusal(space.precision):
        refused[space.hardware.precision_refusal(space.precision)] += 1
        return
    cluster = space.cluster
    schedules = list(space.schedules)
    first_flat = next((s for s in schedules if _flat(s)), None)
    for tp in space.values("tp"):
        if n % tp:
            refused["tp does not divide the GPU count"] += 1
            continue
        if model.heads % tp or model.num_kv_heads % tp:
            refused[f"tp does not divide the attention heads ({model.heads}) and key/value heads "
                    f"({model.num_kv_heads})"] += 1
            continue
        for cp in space.values("cp"):
            if (n // tp) % cp:
                refused["cp does not divide the GPU count / tp"] += 1
                continue
            if not space.tp_across_nodes and tp > domain and n > domain:
                refused[f"tp exceeds the {domain}-GPU NVLink domain (--tp-across-nodes "
                        "allows it)"] += 1
                continue
            if cp > 1 and model.seq_length % (2 * cp):
                refused[f"sequence length {model.seq_length} not divisible by 2 * cp"] += 1
                continue
            for pp in space.values("pp"):
                if (n // (tp * cp)) % pp:
                    refused["pp does not divide the GPU count / (tp * cp)"] += 1
                    continue
                dp = n // (tp * cp * pp)
                if space.dp is not None and dp not in space.dp:
                    refused["dp (GPUs / (tp * cp * pp)) not among the dp values asked"] += 1
                    continue
                if pp > model.layers:
                    refused["pp exceeds the layers"] += 1
                    continue
                yield from _per_layout(space, cluster, tp, cp, pp, dp, gbs, schedules,
                                       first_flat, refused)


def _per_layout(space: SearchSpace, cluster: Cluster, tp: int, cp: int, pp: int, dp: int,
                gbs: int, schedules: list[str], first_flat: str | None,
                refused: Counter) -> Iterator[Plan]:
    model = space.model
    eps = space.values("ep") if model.is_moe else (1,)
    for ep in eps:
        if model.is_moe and (model.experts % ep or (dp * cp) % ep):
            refused["ep does not divide the experts and dp * cp"] += 1
            continue
        dispatchers = space.dispatchers(ep)
        for mbs in space.values("mbs"):
            if gbs % (mbs * dp):
                refused["gbs not divisible by mbs * dp"] += 1
                continue
            m = gbs // (mbs * dp)
            if space.microbatches is not None and m not in space.microbatches:
                refused["microbatches (gbs / (mbs * dp)) not among those asked"] += 1
                continue
            for schedule, vpp in _schedule_vpps(space, schedules, pp, refused):
                if pp == 1 and schedule != first_flat:
                    refused[f"pp = 1 has no pipeline: {first_flat} stands for every vpp = 1 "
                            "schedule"] += 1
                    continue
                stages = pp * vpp
                if stages > model.layers:
                    refused["pp * vpp exceeds the layers"] += 1
                    continue
                if not space.uneven and model.layers % stages:
                    refused["layers not divisible by pp * vpp (Megatron's even split; "
                            "--uneven allows a near-even one)"] += 1
                    continue
                # the two most common refusals counted under a short reason of their own (the
                # builders refuse the same, in longer words, through `_refusal` below)
                if schedule == "interleaved" and (pp < 2 or m < pp or m % pp):
                    refused["interleaved needs pp >= 2 and microbatches a multiple of pp"] += 1
                    continue
                if schedule == "dualpipe" and (pp % 2 or m % 2 or m < 2 * pp):
                    refused["dualpipe needs an even pp and an even number of microbatches "
                            ">= 2 pp"] += 1
                    continue
                if pp > 1 and (why := _refusal(schedule, pp, vpp, m)) is not None:
                    refused[why] += 1
                    continue
                for recompute in space.recompute:
                    if recompute == "selective" and "none" in space.recompute:
                        # flash attention keeps no s x s scores: nothing left to recompute
                        refused["selective recomputation with flash attention is the same plan "
                                "as none"] += 1
                        continue
                    for zero in space.zero:
                        if zero and dp * cp == 1:
                            refused["optimizer sharding needs dp * cp > 1"] += 1
                            continue
                        sp = tp > 1 if space.sequence_parallel is None else space.sequence_parallel
                        layers = space.recompute_layers if recompute == "full" else None
                        for dispatcher in dispatchers:
                            par = Parallelism(tp=tp, pp=pp, dp=dp, vpp=vpp, cp=cp, ep=ep,
                                              sequence_parallel=sp, zero=zero,
                                              recompute=recompute, recompute_layers=layers,
                                              micro_batch_size=mbs,
                                              global_batch_size=gbs, precision=space.precision,
                                              cp_comm=space.cp_comm,
                                              overlap_tp_comm=space.overlap_tp_comm,
                                              overlap_ep_comm=space.overlap_ep_comm
                                              and model.is_moe and ep > 1,
                                              grad_reduce=space.grad_reduce,
                                              grad_reduce_in_fp32=space.grad_reduce_in_fp32,
                                              ep_dispatcher=dispatcher)
                            yield Plan(model, par, cluster, schedule,
                                       efficiency=space.efficiency)


def _flat(schedule: str) -> bool:
    """One stage a rank, no copies: with pp = 1 all such schedules are the same plan."""
    info = schedule_info(schedule)
    return info.searched_vpp == 1 and not info.copies


def _schedule_vpps(space: SearchSpace, schedules: list[str], pp: int,
                   refused: Counter) -> Iterator[tuple[str, int]]:
    for schedule in schedules:
        vpp = schedule_info(schedule).searched_vpp
        if vpp == 2:
            if pp < 2:
                refused[f"{schedule} needs pp >= 2 (two stages a rank in a V)"] += 1
                continue
            yield schedule, 2
        elif vpp is None:
            for vpp in space.values("vpp"):
                if vpp < 2:
                    refused[f"{schedule} with vpp = 1 is 1f1b / gpipe"] += 1
                    continue
                if pp < 2:
                    refused[f"{schedule} needs pp >= 2 for vpp > 1"] += 1
                    continue
                yield schedule, vpp
        else:
            yield schedule, vpp
