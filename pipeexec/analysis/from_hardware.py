"""A run predicted from a hardware file alone, before it runs, as the run is confined.

A hardware file (`pipeexec calibrate-hardware`) states what one device does: on a CPU, one core
running one torch thread, as one pipeexec rank computes. A plan priced with it (`Plan.derive`)
is a step for ranks that each have such a device. A run on this machine rarely has that:

* ``--cpus-per-rank c`` confines each rank to a share ``c`` of a core (a cgroup quota): every
  computation and every transfer (gloo copies through the CPU) takes ``1 / c`` as long;
* unconfined, ``n`` ranks on ``C < n`` cores share them: the simulation shares the pipeline's
  part of them (``C pp / n``: the other copies of the pipeline run beside it) among the ranks
  computing at each moment (``pipesim.simulate(cores=C)``, processor sharing,
  as predictions from a run whose ranks competed for cores do: `pipeexec.analysis.predict`);
* otherwise each rank has its core, and the plan's figures stand.

The prediction moves messages as the executor does (`predict.EXECUTOR_COMM`), runs the program
the executor runs (under ZeRO-2/3 the schedule lowered with the plan's UNSHARD / RESHARD /
REDUCE_GRAD, each waited for: `predict.EXECUTOR_SHARDING`) and is the pipeline's makespan, the
figure ``pipeexec compare`` measures (the optimizer step is not in it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pipesim

from .predict import EXECUTOR_COMM, EXECUTOR_SHARDING
from .tensor_parallel import as_executed

if TYPE_CHECKING:
    from pipesim import SimResult

TIME_FIELDS = ("forward", "backward", "backward_input", "backward_weight", "unshard",
               "reduce_grad")


@dataclass(frozen=True)
class HardwarePrediction:
    """The prediction and how the run's confinement entered it."""

    result: "SimResult"
    hardware: str
    share: float | None          # each rank's share of a core (None: cores shared, `cores`)
    cores: float | None          # the cores the ranks share (None: each rank its own share)

    @property
    def makespan(self) -> float:
        return self.result.makespan

    def describe(self) -> str:
        if self.cores is not None:
            how = f"the ranks sharing {self.cores:g} cores"
        elif self.share is not None and self.share != 1:
            how = f"each rank on {self.share:g} of a core (--cpus-per-rank)"
        else:
            how = "each rank on a core of its own"
        return f"from {self.hardware} alone, {how}"


def confined_costs(costs: "pipesim.CostModel", num_stages: int, share: float
                   ) -> "pipesim.CostModel":
    """``costs`` on ``share`` of the device each: times over ``share``, the transfers' rate
    times ``share``."""
    if not share > 0:
        raise ValueError(f"a rank's share of a core must be positive, got {share!r}")
    changes: dict[str, Any] = {
        name: [v / share for v in costs.stage_values(name, num_stages)]
        for name in TIME_FIELDS if getattr(costs, name) is not None}
    changes["p2p_latency"] = costs.p2p_latency / share
    changes["p2p_bandwidth"] = costs.p2p_bandwidth * share
    return costs.with_(**changes)


def hardware_prediction(config: Any, hardware: Any, *, cpus_per_rank: float | None,
                        host_cpus: float) -> HardwarePrediction:
    """``config``'s pipeline step predicted from ``hardware`` (a `pipesim.Hardware` or a name
    or file `pipesim.hardware.get_hardware` reads) as it will run here: ``cpus_per_rank``
    (None: unconfined) and ``host_cpus``, the CPUs the run may use (see the module)."""
    from pipesim.hardware import get_hardware

    hw = get_hardware(hardware) if isinstance(hardware, str) else hardware
    plan = as_executed(config.plan_as_run())
    plan = plan.with_(cluster=plan.cluster.with_(hardware=hw))
    schedule = config.build_schedule().with_sharding(plan.parallelism.sharding)
    costs = plan.derive().costs.for_schedule(schedule).with_(**EXECUTOR_SHARDING)
    ranks = config.world_size
    share, cores = 1.0, None
    if cpus_per_rank is not None:
        share = float(cpus_per_rank)
        costs = confined_costs(costs, schedule.num_stages, share)
    elif ranks > host_cpus and not str(config.runtime.device).startswith("cuda"):
        # the simulation runs one pipeline (pp ranks); the other dp x tp x cp copies of it
        # run at the same time on the same cores
        share, cores = None, float(host_cpus) * schedule.pp / ranks
    result = pipesim.simulate(schedule, costs, comm=EXECUTOR_COMM, cores=cores)
    name = hardware if isinstance(hardware, str) else hw.name
    return HardwarePrediction(result, str(name), share, cores)
