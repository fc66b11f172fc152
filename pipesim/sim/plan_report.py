"""``pipesim.simulate(plan)``: one step of a plan, with throughput, MFU/HFU and memory per rank.

A :class:`PlanResult` is the simulation's :class:`pipesim.SimResult` (``.sim``, of which
``makespan``, ``bubble_fraction`` and ``trace`` have names here too) plus the plan's figures.
The plan's program (``plan.build_schedule()``: under ZeRO-2/3 with its UNSHARD / RESHARD /
REDUCE_GRAD actions, the program pipeexec runs) is simulated under ``plan.costs()``, which
prices those actions; the trace, Gantt and Chrome trace show them. The in-flight
microbatches, and so the activation peak of each rank, come from the simulator's memory
timeline (not a closed form). The step time is, per rank, the end of its last row (a
computation, or a reduction on its lane) plus the exposed data-parallel communication of its
tail and the optimizer step (:mod:`pipesim.plan.derive`): the latest rank finishing.

* ``tokens_per_s_per_gpu = global_batch * seq_length / step_time / world_size``;
* ``mfu = model FLOPs / (step_time * world_size * peak)``, model FLOPs as Korthikanti et al.
  2022 eq. 7 counts them (no recomputation; :func:`pipesim.plan.flops.model_flops`);
* ``hfu`` the same with the FLOPs recomputation adds (the hardware FLOPs: a recomputed layer's
  forward, or with selective recomputation its attention matmuls once; Korthikanti et al.'s
  Table 5 HFU counts the latter twice, ``1 + s/3h`` for ``1 + s/6h``). With flash attention
  the causal half of the attention matmuls is counted (what the kernels compute, as current
  Megatron-LM's num_floating_point_operations counts it); without it eq. 7's full ``s x s``.
  Both are against the bf16 dense peak whatever the precision, and never above 100%: no
  operator runs faster than the bf16 dense peak (:mod:`pipesim.plan.operators`);
* ``memory_breakdown`` per pipeline rank (weights, gradients, optimizer, activations, buffers;
  activations = simulated peak minus the static parts, so it includes receive buffers): the
  tensors, counted exactly; ``fits`` against the ``usable_memory``, the hardware's capacity
  less its ``memory_reserve`` (CUDA context, NCCL, workspaces) over its ``fragmentation``
  (shown apart from the tensors), with the worst rank, by how much, and the ``headroom`` left.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..hardware import published_check_note
from ..plan.derive import PlanCosts
from ..units import GiB

if TYPE_CHECKING:
    import pandas as pd

    from .result import SimResult
    from ..plan.plan import Plan


@dataclass(frozen=True)
class PlanResult:
    plan: "Plan"
    derived: PlanCosts
    sim: "SimResult"
    pipeline_time: float
    step_time: float
    rank_step_time: list[float]

    # -- the pipeline's own figures (the rest of the simulation: ``sim``) ---------------------
    @property
    def makespan(self) -> float:
        """The simulated schedule's makespan: the pipeline alone (the step adds each rank's
        data-parallel and optimizer tail: `step_time`)."""
        return self.sim.makespan

    @property
    def bubble_fraction(self) -> float:
        return self.sim.bubble_fraction

    @property
    def trace(self) -> "pd.DataFrame":
        """The simulated step, action by action (`pipesim.sim.trace`'s columns)."""
        return self.sim.trace

    # -- throughput ----------------------------------------------------------------------------
    @property
    def tokens_per_s_per_gpu(self) -> float:
        p = self.plan
        return p.parallelism.gbs * p.model.seq_length / self.step_time / p.world_size

    @property
    def mfu(self) -> float:
        return self.derived.model_flops / (self.step_time * self.plan.world_size * self._peak)

    @property
    def hfu(self) -> float:
        return self.derived.hardware_flops / (self.step_time * self.plan.world_size * self._peak)

    @property
    def _peak(self) -> float:
        return self.plan.cluster.hardware.peak_flops

    # -- memory --------------------------------------------------------------------------------
    @property
    def peak_memory(self) -> list[float]:
        return list(self.sim.peak_memory)

    @property
    def memory_breakdown(self) -> list[dict[str, float]]:
        rows = []
        stages = self._rank_parts()
        for r, sts in enumerate(stages):
            row = {k: sum(self.derived.stage_memory[s][k] for s in sts)
                   for k in ("weights", "gradients", "optimizer")}
            row["buffers"] = self.derived.rank_buffers[r]
            static = sum(row.values())
            row["activations"] = max(0.0, self.peak_memory[r] - static)
            row["total"] = self.peak_memory[r]
            rows.append(row)
        return rows

    def _rank_parts(self) -> list[list[int]]:
        """Per rank, the model part of each stage it holds (a copy of a part counts again)."""
        s = self.sim.schedule
        return [[s.stage_part(x) for x in s.rank_stages(r)] for r in range(s.pp)]

    @property
    def memory_limit(self) -> float:
        """The hardware's capacity (the tensors must fit in :attr:`usable_memory`)."""
        return self.plan.cluster.hardware.memory_bytes

    @property
    def usable_memory(self) -> float:
        """Capacity less the reserve, over the fragmentation factor: what tensors may take."""
        return self.plan.cluster.hardware.usable_memory

    @property
    def headroom(self) -> float:
        """Bytes left under :attr:`usable_memory` on the fullest rank (negative: over)."""
        return self.usable_memory - max(self.peak_memory)

    @property
    def fits(self) -> bool:
        return max(self.peak_memory) <= self.usable_memory

    @property
    def fit_message(self) -> str:
        peaks = self.peak_memory
        worst = max(range(len(peaks)), key=peaks.__getitem__)
        hw = self.plan.cluster.hardware
        gap = -self.headroom / GiB
        usable = (f"{self.usable_memory / GiB:.1f} GiB usable of a {hw.name}'s "
                  f"{self.memory_limit / GiB:.1f} GiB ({hw.reserve / GiB:.1f} GiB reserve, "
                  f"fragmentation x{hw.fragmentation:g})")
        if gap <= 0:
            return (f"fits: peak {peaks[worst] / GiB:.1f} GiB on rank {worst}, "
                    f"{-gap:.1f} GiB headroom under the {usable}")
        return (f"does not fit by {gap:.1f} GiB on rank {worst} (peak {peaks[worst] / GiB:.1f} "
                f"GiB of tensors; {usable})")

    @property
    def extrapolated_note(self) -> str:
        """'' or a line saying the times rest on efficiency figures not calibrated here."""
        if not self.derived.extrapolated:
            return ""
        return (f"times extrapolated: {self.plan.cluster.hardware.name}'s efficiency figures "
                "are not calibrated (A100's fit, carried over or scaled by a microbenchmark); "
                "measure them with pipeexec calibrate-hardware and pass --hardware FILE")

    @property
    def published_note(self) -> str:
        """'' or a line saying how far pipesim landed from the published runs its GPU's
        figures were fitted on, for a model of this plan's kind
        (:func:`pipesim.hardware.published_check_note`)."""
        if self.derived.calibration != "fitted":
            return ""
        return published_check_note(self.plan.cluster.hardware, self.plan.model.is_moe)

    # -- output --------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        tail = self.derived.tail
        return {
            "plan": self.plan.to_dict(),
            "step_time": self.step_time,
            "pipeline_time": self.pipeline_time,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "mfu": self.mfu, "hfu": self.hfu,
            "efficiency": self.derived.efficiency,
            "bubble_fraction": self.sim.bubble_fraction, "bubble_rate": self.sim.bubble_rate,
            "model_flops": self.derived.model_flops, "hardware_flops": self.derived.hardware_flops,
            "peak_memory": self.peak_memory,
            "memory_breakdown": self.memory_breakdown,
            "memory_limit": self.memory_limit,
            "memory_reserve": self.plan.cluster.hardware.reserve,
            "fragmentation": self.plan.cluster.hardware.fragmentation,
            "usable_memory": self.usable_memory, "headroom": self.headroom,
            "fits": self.fits, "fit_message": self.fit_message,
            "calibration": self.derived.calibration,
            "step_tail": [asdict(t) for t in tail],
            "stage_layers": self.derived.stage_layers,
            "links": {k: {"kind": v.kind, "latency": v.latency, "bandwidth": v.bandwidth,
                          # across NVLink domains: how many the group spans, its fewest
                          # members in one (the NICs its ring runs on there)
                          **({"domains": v.nodes, "per_domain": v.per_domain}
                             if v.kind == "inter" else {}),
                          **({"collectives": [{"collective": n, "p": q, "latency": lat,
                                               "bandwidth": bw} for n, q, lat, bw in v.collectives]}
                             if v.collectives else {})}
                      for k, v in self.derived.links.items()},
        }

    def save(self, path: "str | Path") -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def summary_text(self) -> str:
        p = self.plan
        lines = [repr(p),
                 f"step {self.step_time:.4g} s (pipeline {self.pipeline_time:.4g} s)   "
                 f"{self.tokens_per_s_per_gpu:,.0f} tokens/s/GPU   MFU {self.mfu:.1%}   "
                 f"HFU {self.hfu:.1%}   efficiency {self.derived.efficiency:.3f}   "
                 f"bubble_fraction {self.sim.bubble_fraction:.4f}",
                 f"{'rank':>4} {'layers':>7} {'weights':>8} {'grads':>8} {'optim':>8} "
                 f"{'activ':>8} {'buffers':>8} {'peak GiB':>9} {'dp exposed ms':>14} {'optim ms':>9}"]
        stages = self._rank_parts()
        for r, row in enumerate(self.memory_breakdown):
            nl = sum(self.derived.stage_layers[s] for s in stages[r])
            t = self.derived.tail[r]
            lines.append(f"{r:>4} {nl:>7} " + " ".join(
                f"{row[k] / GiB:>8.2f}" for k in ("weights", "gradients", "optimizer",
                                                 "activations", "buffers"))
                + f" {row['total'] / GiB:>9.2f} {t.dp_exposed * 1e3:>14.2f} {t.optimizer * 1e3:>9.2f}")
        lines.append(self.fit_message)
        if self.extrapolated_note:
            lines.append(self.extrapolated_note)
        if self.published_note:
            lines.append(self.published_note)
        return "\n".join(lines)

    def gantt(self, **kwargs: Any):
        return self.sim.gantt(**kwargs)

    def to_chrome_trace(self, path: "str | Path | None" = None) -> dict:
        return self.sim.to_chrome_trace(path)

    def __repr__(self) -> str:
        return (f"PlanResult(step_time={self.step_time:.4g} s, mfu={self.mfu:.3f}, "
                f"hfu={self.hfu:.3f}, fits={self.fits})")


def simulate_plan(plan: "Plan", *, comm: str = "async", validate: bool = True,
                  jitter: float = 0.0, seed: int = 0) -> PlanResult:
    """Simulate one step of ``plan``; see the module docstring. ``jitter`` and ``seed`` go to
    :func:`pipesim.simulate` (compute times scaled by noise, for ranking-stability checks)."""
    # lazy: pipesim.plan (and so pipesim.Plan) imports without simpy and numpy
    from .engine import simulate

    if validate:
        plan.validate()
    derived = plan.derive()
    schedule = plan.build_schedule()
    sim = simulate(schedule, derived.costs, comm=comm, jitter=jitter, seed=seed)
    ends = sim.rank_end
    pipeline = max(ends)
    rank_step = [(ends[r] if r < len(ends) else 0.0) + t.dp_exposed + t.optimizer
                 for r, t in enumerate(derived.tail)]
    return PlanResult(plan, derived, sim, pipeline, max(rank_step), rank_step)
