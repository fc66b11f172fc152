"""The training step and loop, built from explicit objects.

`Trainer` owns what one rank needs (its stages, fp32 master weights, gradient buffer, AdamW,
loss scaler, runtime, data source) and exposes `step()`, `forward()` and a state dict keyed by
global parameter names. `train()` is the loop: it takes a Trainer and an optional per-step
callback, so a checkpoint manager can load state into the Trainer before the loop and save it
from the callback. ``iteration`` counts optimizer iterations (skipped fp16 steps included, as
Megatron's ``--train-iters``); ``updates`` counts the steps that changed the weights and drives
the learning rate.

One step: zero the fp32 gradient buffer, run this rank's schedule actions, average gradients
over the data-parallel group (one bucketed all-reduce), then one all-reduce over all ranks of
[squared gradient norm / dp, loss sum]: it gives the global norm for clipping, the inf/nan check
every rank agrees on (fp16 skips the step together) and the mean loss of the global batch.

The gradients, fp32 masters and AdamW state are a `training.holder.GradientHolder`'s: the
replicated one (`holder.ReplicatedOptimizer`, one averaging all-reduce) or, with ``--zero 1|2|3``
and more than one data-parallel replica, ZeRO's (`training.zero.ShardedOptimizer`; under
ZeRO-2/3 the runtime's schedule carries its UNSHARD / RESHARD / REDUCE_GRAD actions,
`pipesim.schedule.sharding`): it reduce-scatters instead of all-reducing, gives its
shard's squared norm (summed over all ranks in the same all-reduce, not divided by dp) and
steps its shard. The step asks the holder, never which one it is.

Expert parallelism (``ep`` > 1, `parallel.experts`): a MoE layer's experts are cut over the ep
group; their gradients are summed over the expert-data-parallel group and divided by dp x cp
as the dense ones (`ddp.GradBuffer.all_reduce_experts`; under ZeRO the
`zero.ExpertShardedOptimizer` shards them over that group), each counted once in the norm.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pipesim import Schedule
from pipesim.progress import progress_bar
from pipesim.schedule.op import Op

from .metrics_log import (LogOptions, model_flops_per_step, open_sinks, step_scalars,
                          valid_scalars, writes_metrics)
from .rank import RankParts
from .tied import tied_parameters
from .validation import EvalOptions, Evaluation, valid_batches
from .holder import GradientHolder, ReplicatedOptimizer, gradient_holder
from .optim import clip_coefficient, lr_at
from ..pipeline.p2p import check_channels_exist, check_p2p_order
from .divergence import DivergenceGuard
from .precision import LossScaler
from ..pipeline.runtime import ActionObserver, PipelineRuntime, StageHooks
from ..parallel.context import ContextParallelBatches
from ..models.hf_expert_parallel import is_expert
from ..parallel.tp_grads import TensorParallelGrads


@dataclass
class StepStats:
    iteration: int
    loss: float
    step_time: float
    grad_norm: float
    lr: float
    loss_scale: float
    skipped: bool
    tokens_per_s: float
    # CUDA: the step's allocator peaks (torch.cuda.max_memory_allocated / _reserved, bytes,
    # reset at the step's start); NaN on CPU
    max_memory_allocated: float = math.nan
    max_memory_reserved: float = math.nan


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    loss_scales: list[float] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    tokens_per_s: list[float] = field(default_factory=list)
    max_memory_allocated: list[float] = field(default_factory=list)
    max_memory_reserved: list[float] = field(default_factory=list)
    # each evaluation's `validation.Evaluation.to_dict` (iteration, loss, iters, seconds)
    validation: list[dict] = field(default_factory=list)

    def add(self, s: StepStats) -> None:
        self.max_memory_allocated.append(s.max_memory_allocated)
        self.max_memory_reserved.append(s.max_memory_reserved)
        self.losses.append(s.loss)
        self.step_times.append(s.step_time)
        self.grad_norms.append(s.grad_norm)
        self.lrs.append(s.lr)
        self.loss_scales.append(s.loss_scale)
        self.skipped.append(s.skipped)
        self.tokens_per_s.append(s.tokens_per_s)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class Trainer:
    def __init__(self, parts: RankParts) -> None:
        """Train the rank ``parts`` holds (`pipeexec.run.assemble` builds it: ``trainer =
        assemble(config, topology)``): this builds its training state (gradient holder, fp32
        masters, AdamW, loss scale) and the runtime."""
        config, topology, spec = parts.config, parts.topology, parts.spec
        self.config, self.topology, self.spec = config, topology, spec
        self.tp, self.cp, self.ep = parts.tp, parts.cp, parts.ep
        self.schedule, self._custom_schedule = parts.schedule, parts.custom_schedule
        self.bounds, self.stages, self.dtype = parts.bounds, parts.stages, parts.dtype
        # Stage parameters are already named by global layer index: layers.<i>.<name>.
        named = [(name, p) for s in sorted(self.stages) for name, p in self.stages[s].named_parameters()]
        self.param_names = [n for n, _ in named]
        # Who holds the gradients, fp32 masters and AdamW state (`training.holder`): ZeRO 1-3
        # sharded over the data-parallel group, or replicated; the step talks to it only.
        self.holder: GradientHolder = gradient_holder(config, topology, self.stages,
                                                      names=self.param_names, dtype=self.dtype,
                                                      is_expert=is_expert)
        # Parameters held more than once (a tied head, a schedule's second copy of a stage):
        # one value, summed gradients, counted once in the norm.
        self.tied = tied_parameters([(n, spec.canonical(n), p, self.holder.grad_view(p))
                                     for n, p in named],
                                    # a "replica" is one pipeline: one (dp, cp, tp) position
                                    pp_rank=topology.pp_rank,
                                    dp_rank=topology.dp_cp_rank * topology.tp + topology.tp_rank,
                                    dp=topology.dp_cp * topology.tp,
                                    rank_of=lambda p, d: topology.rank_of(
                                        pp_rank=p, dp_rank=d // (topology.tp * topology.cp),
                                        cp_rank=d // topology.tp % topology.cp,
                                        tp_rank=d % topology.tp),
                                    timeout=config.runtime.collective_timeout)
        self.tied.copy_from_source()
        self.tp_grads = TensorParallelGrads([p for _, p in named], self.holder.grad_pieces,
                                            self.tp)
        self.holder.start(self.tied)        # masters and AdamW (ZeRO-3 releases the weights)
        self.stage_hooks: tuple[StageHooks, ...] = ()
        precision, mp = config.plan.parallelism.precision, config.mixed_precision
        self.scaler = LossScaler(dynamic=precision == "fp16", initial=mp.loss_scale,
                                 growth=mp.loss_scale_growth, backoff=mp.loss_scale_backoff,
                                 growth_interval=mp.loss_scale_growth_interval,
                                 min_scale=mp.min_loss_scale)
        self.divergence = DivergenceGuard(dynamic_scale=self.scaler.dynamic, precision=precision,
                                          max_skipped_steps=mp.max_skipped_steps)
        # a step's loss summed over its m microbatches on every dp x cp rank (each cp rank's
        # over its chunks of the sequences), divided by this: the mean per microbatch
        par = config.plan.parallelism
        self._losses_per_step = config.plan.microbatches * par.dp * par.cp
        self._overflow = parts.overflow
        self.board, self._board_observer = parts.board, parts.board_observer
        self.observers: list[ActionObserver] = list(parts.observers)
        self.p2p = parts.p2p
        self.runtime = self._make_runtime(self.schedule)
        self._fwd_runtime: PipelineRuntime | None = None
        self.data = parts.data
        self.iteration = 0
        self.updates = 0
        self.holds_last_stage = config.num_stages - 1 in self.stages

    def add_observer(self, observer: ActionObserver) -> None:
        """Hook ``observer`` into the runtime (and into any runtime `set_schedule` builds)."""
        if observer not in self.observers:
            self.observers.append(observer)
        self.runtime.add_observer(observer)

    def add_stage_hooks(self, hooks: StageHooks) -> None:
        """Run ``hooks`` around every F, B, I and W from the next step on
        (`pipeexec.pipeline.runtime.StageHooks`; a memory meter reading inside the actions,
        which ZeRO-3's UNSHARD / RESHARD surround). Rebuilds the runtimes, keeping their
        observers."""
        self.stage_hooks = (*self.stage_hooks, hooks)
        self.runtime = self._make_runtime(self.schedule)
        self._fwd_runtime = None

    def state_tensors(self) -> list[torch.Tensor]:
        """The training state this rank holds now, for a memory meter: its parameters,
        gradient buffers, fp32 masters and AdamW state (ZeRO's shards and whatever transient
        buffer is alive; a released ZeRO-3 parameter has an empty storage)."""
        params = [p for s in sorted(self.stages) for p in self.stages[s].parameters()]
        return params + list(self.holder.held_tensors())

    # What tests and tools read of the holder: the ZeRO one (None when replicated), the
    # replicated one's gradient buffer and masters (None under ZeRO), AdamW.
    @property
    def sharded(self):
        return None if isinstance(self.holder, ReplicatedOptimizer) else self.holder

    @property
    def grads(self):
        return getattr(self.holder, "buffer", None)

    @property
    def masters(self):
        return getattr(self.holder, "masters", None)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.holder.optimizer

    def _make_runtime(self, schedule: Schedule) -> PipelineRuntime:
        topology, config = self.topology, self.config
        # ZeRO-2/3: the program carries the holder's UNSHARD / RESHARD / REDUCE_GRAD actions
        return PipelineRuntime(schedule.with_sharding(self.holder.sharding), topology.pp_rank,
                               self.stages, self.spec.loss_fn,
                               self.holder.accumulate, self.p2p, global_rank=topology.rank,
                               device=topology.device, compute_dtype=self.dtype,
                               observers=self.observers,
                               deallocate_outputs=config.runtime.deallocate_outputs,
                               # fp32: the masters are the parameters, .grad bound above
                               # (ZeRO-2/3: any dtype, the holder takes each .grad)
                               grads_in_place=self.holder.grads_in_place,
                               stage_hooks=self.stage_hooks, sharding=self.holder)

    def set_schedule(self, schedule: Schedule) -> None:
        """Run ``schedule`` from the next step on. Every rank must switch at the same step
        (the caller's collective decision); the stages stay, so the schedule must put the same
        stages on this rank. The new runtime has the same observers."""
        got = (schedule.pp, schedule.parts_per_rank, schedule.num_microbatches)
        cfg = self.config
        ours = (cfg.plan.parallelism.pp, cfg.plan.parallelism.vpp, cfg.plan.microbatches)
        if got != ours:
            raise ValueError(f"schedule {schedule.name!r} has pp, vpp, microbatches = {got}, the "
                             f"run {ours}")
        schedule.validate()
        mine = set(schedule.rank_stages(self.topology.pp_rank))
        if mine != set(self.stages) or any(schedule.stage_part(s) != self.schedule.stage_part(s)
                                           for s in mine):
            raise ValueError(f"schedule {schedule.name!r} puts stages {sorted(mine)} (model parts "
                             f"{[schedule.stage_part(s) for s in sorted(mine)]}) on pp rank "
                             f"{self.topology.pp_rank}, which holds {sorted(self.stages)} (parts "
                             f"{[self.schedule.stage_part(s) for s in sorted(self.stages)]})")
        if self.p2p is not None:
            check_channels_exist(schedule, self.topology.pp_rank, self.topology.p2p_groups)
            if self.topology.backend == "nccl" or cfg.runtime.nccl_matching:
                check_p2p_order(schedule, collectives=self.topology.tp > 1
                                or self.topology.cp > 1 or self.topology.ep > 1
                                or cfg.plan.parallelism.zero >= 2)
        self.schedule = schedule
        self._custom_schedule = True
        self.runtime = self._make_runtime(schedule)
        self._fwd_runtime = None

    # -- one optimizer step -----------------------------------------------------------------
    def step(self) -> StepStats:
        """One optimizer step (or, when the schedule is forward-only, one evaluation step)."""
        cfg, topo = self.config, self.topology
        k = self.iteration
        t0 = time.perf_counter()
        if self.topology.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.topology.device)
        if self.schedule.forward_only:
            return with_peaks(self._eval_step(k, t0), self.topology.device)
        self.holder.zero()
        out = self.runtime.run(self._microbatches(self.data, k), step=k,
                               loss_scale=self.scaler.scale)
        if self.board is not None:
            self.board.set(topo.rank, k, Op.ALLREDUCE, -1, -1)
        # each gradient (ZeRO: each shard's) the dp x cp group's average, tied ones summed
        self.holder.reduce_gradients()
        self.tp_grads.reduce_sequence_parallel()
        if k in self._overflow and self.holds_last_stage:
            self.holder.poison()
        # this rank's share of the squared norm, summed over all ranks below; a parameter
        # replicated over tp counts once
        share = self.holder.local_grad_sq(minus=self.tp_grads.duplicate_sq())
        # the loss is the same on every tp rank of the last stage: counted on tp rank 0; each
        # cp rank's is the mean over its tokens (as many on every cp rank): averaged over cp
        loss_sum = (torch.stack(list(out.losses.values())).sum().float()
                    if out.losses and topo.tp_rank == 0 else torch.zeros((), device=topo.device))
        vec = torch.stack([share, loss_sum.to(share.device)])
        if topo.world_size > 1:
            dist.all_reduce(vec)
        sq, loss_total = vec.tolist()
        found_inf = not math.isfinite(sq)
        scale = self.scaler.scale
        # a diverged run stops here, on every rank alike, before the optimizer step
        self.divergence.check(k, loss_total / self._losses_per_step, sq, scale)
        opt = cfg.optimizer
        lr = lr_at(self.updates, lr=opt.lr, min_lr=opt.min_lr, warmup=opt.warmup_steps,
                   decay_steps=opt.decay_steps or opt.steps)
        norm = math.sqrt(sq) / scale if not found_inf else float("inf")
        if self.board is not None:
            self.board.set(topo.rank, k, Op.OPTIMIZER, -1, -1)
        if not found_inf:
            self.holder.step(clip_coefficient(norm, opt.clip_grad) / scale, lr)
            self.updates += 1
        self.scaler.update(found_inf)
        self.iteration += 1
        dt = time.perf_counter() - t0
        return with_peaks(StepStats(k, loss_total / self._losses_per_step, dt, norm, lr, scale,
                                    found_inf, self._tokens_per_step() / dt),
                          self.topology.device)

    def _eval_step(self, k: int, t0: float) -> StepStats:
        topo = self.topology
        out = self.runtime.run(self._microbatches(self.data, k), step=k, forward_only=True)
        dev = topo.device
        loss = (torch.stack(list(out.losses.values())).sum().float()
                if out.losses and topo.tp_rank == 0 else torch.zeros((), device=dev))
        if topo.world_size > 1:
            dist.all_reduce(loss)
        self.iteration += 1
        dt = time.perf_counter() - t0
        return StepStats(k, loss.item() / self._losses_per_step, dt, 0.0, 0.0,
                         self.scaler.scale, True, self._tokens_per_step() / dt)

    # -- forward only -----------------------------------------------------------------------
    def forward(self, step: int, keep_outputs: bool = False):
        """Forward-only pass over the batch of ``step``; returns this rank's StepOutput."""
        return self._forward_runtime().run(self._microbatches(self.data, step), step=step,
                                           forward_only=True, keep_outputs=keep_outputs)

    def _microbatches(self, data: Any, step: int) -> list:
        """This rank's microbatches of ``step`` from ``data`` (its replica's m of them), on
        its device."""
        return pinned(data.microbatches(step, self.topology.dp_rank,
                                        self.config.plan.parallelism.dp,
                                        self.config.plan.microbatches), self.topology.device)

    def _tokens_per_step(self) -> int:
        return self.config.global_batch * self.config.plan.model.seq_length

    @torch.no_grad()
    def evaluate(self, data, iters: int) -> float:
        """The mean loss of validation batches ``0 .. iters - 1`` of ``data`` (a
        `training.validation.ValidationData`), each cut into this run's replicas and
        microbatches, through the forward-only schedule with the stages in eval mode (no
        dropout); the weights and the training state are untouched. Collective: every rank
        calls it; all get the same value."""
        topo = self.topology
        if self.cp.active:
            data = ContextParallelBatches(data, self.cp)
        runtime = self._forward_runtime()
        modes = {s: st.training for s, st in self.stages.items()}
        total = torch.zeros((), dtype=torch.float64, device=topo.device)
        try:
            for st in self.stages.values():
                st.eval()
            for i in range(iters):
                out = runtime.run(self._microbatches(data, i), step=self.iteration,
                                  forward_only=True)
                if out.losses and topo.tp_rank == 0:   # tp ranks of the last stage: one loss
                    total += torch.stack(list(out.losses.values())).double().sum()
        finally:
            for s, st in self.stages.items():
                st.train(modes[s])
        if topo.world_size > 1:
            dist.all_reduce(total)
        return total.item() / (iters * self._losses_per_step)

    def _forward_runtime(self) -> PipelineRuntime:
        """The runtime of the forward-only variant of this run's schedule (built once)."""
        if self._fwd_runtime is None:
            cfg = self.config
            if self._custom_schedule:
                s = self.schedule   # the forwards of the schedule, in its order
                sched = s.with_orders([[a for a in s.compute_parts(r) if a.op == "F"]
                                       for r in range(s.pp)],
                                      name=f"{s.name} (forward only)",
                                      forward_only=True).validate()
            else:               # the builder's (or the file's) forward-only schedule
                forward = dataclasses.replace(cfg.runtime, forward_only=True)
                sched = cfg.replace(runtime=forward).build_schedule()
            self._fwd_runtime = PipelineRuntime(sched.with_sharding(self.holder.sharding),
                                                self.topology.pp_rank, self.stages,
                                                self.spec.loss_fn, self.holder.accumulate,
                                                self.p2p, global_rank=self.topology.rank,
                                                device=self.topology.device, compute_dtype=self.dtype,
                                                observers=[o for o in (self._board_observer,)
                                                           if o is not None],
                                                stage_hooks=self.stage_hooks,
                                                sharding=self.holder)
        return self._fwd_runtime

    # -- state, keyed by global parameter names ---------------------------------------------
    def named_parameters(self) -> dict[str, torch.Tensor]:
        """fp32 master weights of this rank, by global name ``layers.<i>.<name>``, whole.
        Under ZeRO gathered from the shards (fresh tensors): collective over the dp group."""
        return self.holder.full_masters()

    @contextlib.contextmanager
    def whole_parameters(self):
        """Inside: every stage's weights whole, for code that runs the stages outside the
        runtime (the split-backward probe). Under ZeRO-3 gathered and released after:
        collective over the dp group, every rank of which enters it; else nothing to do."""
        self.holder.gather_all()
        try:
            yield
        finally:
            self.holder.release_all()

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each parameter's shape by global name (no collective, whatever the zero level)."""
        return {n: tuple(p.shape) for s in sorted(self.stages)
                for n, p in self.stages[s].named_parameters()}

    def full_state(self) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
        """(fp32 masters, AdamW state) by global name, whole tensors (a parameter never
        stepped has no AdamW entry). Under ZeRO gathered from the shards: collective over the
        dp group, every rank of which calls it (a checkpoint save, `state_dict`)."""
        return self.holder.full_masters(), self.holder.full_optimizer_state()

    def state_dict(self) -> dict:
        """Collective under ZeRO (see `full_state`)."""
        masters, opt = self.full_state()
        opt_state = {name: {k: (v.detach().clone() if torch.is_tensor(v) else v)
                            for k, v in st.items()} for name, st in opt.items()}
        return {"model": {n: p.detach().clone() for n, p in masters.items()},
                "optimizer": opt_state, "scaler": self.scaler.state_dict(),
                "iteration": self.iteration, "updates": self.updates,
                "config": self.config.to_dict(), "bounds": self.bounds}

    @torch.no_grad()
    def load_state_dict(self, state: dict, *, load_optim: bool = True) -> None:
        """Load the entries for this rank's parameters (any layout may have written them)."""
        model = state["model"]
        missing = [n for n in self.param_names if n not in model]
        if missing:
            raise KeyError(f"state lacks parameters {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        for name, shape in self.param_shapes().items():
            if tuple(model[name].shape) != shape:
                raise ValueError(f"parameter {name}: shape {tuple(model[name].shape)} in the "
                                 f"state, {shape} in the model")
        self.holder.load(model, state["optimizer"] if load_optim else None)
        if load_optim:
            self.scaler.load_state_dict(state["scaler"])
        self.iteration, self.updates = int(state["iteration"]), int(state["updates"])


def with_peaks(stats: StepStats, device: torch.device) -> StepStats:
    """``stats`` with the step's CUDA allocator peaks (unchanged on CPU)."""
    if device.type != "cuda":
        return stats
    return dataclasses.replace(stats, max_memory_allocated=float(torch.cuda.max_memory_allocated(device)),
                               max_memory_reserved=float(torch.cuda.max_memory_reserved(device)))


def pinned(microbatches, device: torch.device):
    """On CUDA, the microbatches in pinned memory, so their copies to the GPU are asynchronous
    (a non_blocking copy from pageable memory is a synchronous staged copy)."""
    if device.type != "cuda":
        return microbatches
    return [tuple(t.pin_memory() for t in mb) for mb in microbatches]


def train(trainer: Trainer, *, on_step: Callable[[Trainer, StepStats], None] | None = None,
          log: Callable[[str], None] | None = None, progress: bool = False,
          evaluation: EvalOptions | None = None, logging: LogOptions | None = None
          ) -> TrainResult:
    """Run steps until ``trainer.iteration == config.optimizer.steps``; log on global rank 0:
    a line per ``logging.log_interval`` steps, or, with ``progress`` and stdout a terminal, a
    progress bar with its ETA. ``evaluation``: the validation loss every ``eval_interval``
    iterations and at the end (`training.validation`; ``eval_only``: once, no training);
    ``logging``: its TensorBoard / W&B scalars, written by the rank holding the loss
    (`training.metrics_log`)."""
    cfg = trainer.config
    steps = cfg.optimizer.steps
    result = TrainResult()
    is_logger = trainer.topology.rank == 0
    interval = logging.log_interval if logging is not None else 1
    valid = (valid_batches(cfg, evaluation)
             if evaluation is not None and evaluation.active else None)
    sinks = (open_sinks(logging, cfg)
             if logging is not None and logging.active
             and writes_metrics(trainer.topology, trainer.holds_last_stage) else [])
    flops = model_flops_per_step(cfg) if sinks else 0.0
    skipped = 0
    bar = None
    if progress and is_logger:
        bar = progress_bar(total=steps, initial=trainer.iteration, desc="train", unit="step",
                           file=sys.stdout, dynamic_ncols=True)
        if bar.disable:             # not a terminal: the step lines instead
            bar.close()
            bar = None

    def say(msg: str) -> None:
        if not is_logger or log is None:
            return
        if bar is not None:
            bar.write(msg)
        else:
            log(msg)

    def validate() -> None:
        t0 = time.perf_counter()
        loss = trainer.evaluate(valid, evaluation.eval_iters)
        done = Evaluation(trainer.iteration, loss, evaluation.eval_iters,
                          time.perf_counter() - t0)
        result.validation.append(done.to_dict())
        say(f"validation iteration {done.iteration} loss {loss:.4f} ppl {done.perplexity:.3f} "
            f"({done.iters} batch{'es' if done.iters != 1 else ''}, "
            f"{done.seconds * 1e3:.1f} ms)")
        if bar is not None:
            bar.set_postfix_str(f"loss {result.losses[-1]:.4f} valid {loss:.4f}"
                                if result.losses else f"valid {loss:.4f}")
        for sink in sinks:
            sink.scalars(trainer.iteration, valid_scalars(loss))

    try:
        if evaluation is not None and evaluation.eval_only:
            validate()
            return result
        evaluated_at = None
        while trainer.iteration < steps:
            stats = trainer.step()
            result.add(stats)
            skipped += stats.skipped
            done = stats.iteration + 1
            due = done % interval == 0 or done == steps
            if bar is None and due:
                # Steps are numbered from 0 everywhere (--profile A:B, traces, reports,
                # errors); "k of N" counts iterations done, as the checkpoint names do.
                msg = (f"step {stats.iteration} ({stats.iteration + 1} of {steps}) "
                       f"loss {stats.loss:.4f} "
                       f"step_time {stats.step_time * 1e3:.1f} ms tokens/s {stats.tokens_per_s:,.0f} "
                       f"lr {stats.lr:.2e} grad_norm {stats.grad_norm:.3f}")
                if trainer.scaler.dynamic:
                    msg += f" loss_scale {stats.loss_scale:g}" + (" SKIPPED" if stats.skipped else "")
                say(msg)
            if bar is not None:
                bar.set_postfix_str(f"loss {stats.loss:.4f} lr {stats.lr:.2e} "
                                    f"{stats.tokens_per_s:,.0f} tok/s")
                bar.update(1)
            if due:
                for sink in sinks:
                    sink.scalars(done, step_scalars(stats, cfg, flops, skipped))
            if on_step is not None:
                on_step(trainer, stats)
            if valid is not None and trainer.iteration % evaluation.eval_interval == 0:
                validate()
                evaluated_at = trainer.iteration
        if valid is not None and result.losses and evaluated_at != trainer.iteration:
            validate()              # the end of training, as Megatron's last evaluation
    finally:
        if bar is not None:
            bar.close()
        for sink in sinks:
            sink.close()
    return result
