"""Profiling one training run, from start-up to the gathered trace.

`ProfileSession` is what a worker creates when ``--profile A:B`` is given:

1. at start-up, clocks are aligned to global rank 0 (:mod:`pipeexec.measuring.clock`);
2. ``attach`` adds its `ActionProfiler` to the trainer's runtime observers (action times,
   receive waits, message sizes) with a memory meter (exact held tensors, on CPU and GPU
   alike);
3. after training, ``finish`` times each stage's F, B, I and W outside the schedule
   (:mod:`pipeexec.measuring.probe`, what a run without I/W cannot show), gathers every rank's
   records to rank 0 (one ``gather_object``) and builds a `MeasuredRun` there; with
   ``trace_out`` it is written to disk.

Only the pipeline of data-parallel replica 0 goes into the trace (every replica runs the same
schedule; one pipeline is one timeline).
"""
from __future__ import annotations

import math
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .clock import ClockOffset, align_clocks
from ..analysis.measured_run import MeasuredRun, build_trace
from ..analysis.profile_meta import Measurement, StageProbe
from .memory import HeldTensorMeter
from .probe import probe_layers, probe_split
from ..launching.cpu_quota import cpu_limit
from .profile_options import ProfileOptions, parse_step_range
from .recorder import ActionProfiler
from ..analysis.run_plan import RunPlan


class ProfileSession:
    """One rank's part of a profiled run (see the module docstring). Collective: every rank
    of the job creates one, and every rank calls ``finish``."""

    def __init__(self, options: ProfileOptions, topology: Any, *,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.options = options
        self.topology = topology
        self.clock = clock
        self.offset: ClockOffset = align_clocks(topology.rank, topology.world_size,
                                                rounds=options.align_rounds,
                                                timeout=options.timeout, clock=clock,
                                                device=topology.device)
        self.profiler = ActionProfiler(options.first, options.stop, device=topology.device,
                                       clock=clock)

    def attach(self, trainer: Any) -> None:
        """Hook the profiler into ``trainer``'s runtime (an observer: action times, receive
        waits, message sizes) with a held-tensor memory meter over the runtime's held state."""
        trainer.add_observer(self.profiler)
        # The held-tensor meter on every device: it counts what the runtime holds, which is
        # device-independent. On a GPU, memory_allocated read at host time runs ahead of the
        # device and counts tensors still being sent as freed (CudaMemoryMeter stays available
        # to compare against; per-step allocator peaks are in the metrics).
        runtime = trainer.runtime
        params = [p for st in runtime.stages.values() for p in st.parameters()]
        self.profiler.memory = HeldTensorMeter(runtime, exclude=params)

    def finish(self, trainer: Any) -> MeasuredRun | None:
        """Gather to global rank 0; return the `MeasuredRun` there (None elsewhere)."""
        memory = self.profiler.memory
        if isinstance(memory, HeldTensorMeter):
            memory.close()
        topo = self.topology
        probe = layers = None
        if self.options.probe_split and not trainer.config.runtime.forward_only:
            # ZeRO-3: the stages' weights gathered (collective over dp) while dp rank 0 probes
            # (with ep the probe's layers run the all-to-alls: whole cp and ep groups probe,
            # the first lcm(cp, ep) ranks of dp x cp, dp rank 0's among them)
            cp, ep = getattr(topo, "cp", 1), getattr(topo, "ep", 1)
            with trainer.whole_parameters():
                if topo.dp_rank * cp + getattr(topo, "cp_rank", 0) < math.lcm(cp, ep):
                    probe = probe_split(trainer)
                    layers = probe_layers(trainer)
        # One pipeline's records make the trace: the one at dp rank 0, cp rank 0 and tp rank 0
        # (the other tp and cp ranks of a stage run the same actions, in step with it through
        # their collectives).
        tp_rank, cp_rank = getattr(topo, "tp_rank", 0), getattr(topo, "cp_rank", 0)
        recorder = topo.dp_rank == 0 and tp_rank == 0 and cp_rank == 0
        payload = {"rank": topo.rank, "pp_rank": topo.pp_rank, "dp_rank": topo.dp_rank,
                   "tp_rank": tp_rank, "cp_rank": cp_rank, "offset": self.offset.offset,
                   "rtt": self.offset.rtt,
                   "records": self.profiler.records() if recorder else [],
                   "split_probe": probe, "layer_probe": layers, "cpus": rank_cpus(),
                   "host": socket.gethostname(), "host_cpus": os.cpu_count()}
        if topo.world_size > 1:
            gathered: list | None = [None] * topo.world_size if topo.rank == 0 else None
            dist.gather_object(payload, gathered, dst=0)
        else:
            gathered = [payload]
        if topo.rank != 0:
            return None
        pipeline = sorted((p for p in gathered
                           if p["dp_rank"] == 0 and p["tp_rank"] == 0 and p["cp_rank"] == 0),
                          key=lambda p: p["pp_rank"])
        cfg = trainer.config
        # the program that ran: the schedule lowered with the holder's sharding (ZeRO-2/3's
        # UNSHARD / RESHARD / REDUCE_GRAD), which the trace's rows and the simulation follow
        schedule = trainer.runtime.schedule
        trace = build_trace([p["records"] for p in pipeline], [p["offset"] for p in pipeline],
                            schedule)
        plan = RunPlan(schedule, trainer.bounds, trainer.spec.kinds(),
                       dp=cfg.plan.parallelism.dp,
                       device=str(topo.device), backend=topo.backend, hosts=host_loads(gathered),
                       rank_cpus=tuple(p["cpus"] for p in pipeline), host_cpus=os.cpu_count(),
                       cpus_per_rank=self.options.cpus_per_rank, config=cfg.to_dict(),
                       schedule_name=cfg.plan.schedule_name)
        measurement = Measurement(
            clock_offsets=tuple(p["offset"] for p in pipeline),
            clock_rtts=tuple(p["rtt"] for p in pipeline),
            profiled_steps=(self.options.first, self.options.stop), memory="held_tensors",
            split_probe={int(s): StageProbe.from_meta(v) for p in pipeline
                         for s, v in (p["split_probe"] or {}).items()})
        run = MeasuredRun.of_plan(trace, plan, measurement)
        # the embedding and the head timed alone (`probe_layers`), read by `MeasuredRun.layer_shares`
        layer_probe = {str(s): v for p in pipeline for s, v in (p.get("layer_probe") or {}).items()}
        if layer_probe:
            run.meta["layer_probe"] = layer_probe
        if self.options.trace_out:
            run.save(self.options.trace_out)
        return run


def host_loads(payloads: list[dict]) -> dict[str, dict[str, float]]:
    """Per host, over every rank of the job (all replicas): its CPUs, how many ranks ran there,
    the CPUs they could keep busy together, and the most any one of them could (below 1 for
    every rank: all confined to shares)."""
    hosts: dict[str, dict[str, float]] = {}
    for p in payloads:
        h = hosts.setdefault(p["host"], {"cpus": p["host_cpus"], "ranks": 0, "rank_cpus": 0.0,
                                         "max_rank_cpus": 0.0})
        h["ranks"] += 1
        h["rank_cpus"] += p["cpus"]
        h["max_rank_cpus"] = max(h["max_rank_cpus"], p["cpus"])
    return hosts


def rank_cpus() -> float:
    """CPUs this rank can keep busy: its intra-op threads, capped by the CPUs it may use."""
    return float(min(cpu_limit(), torch.get_num_threads()))
