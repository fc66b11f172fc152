"""Shared pieces of the pipeexec tests: a tiny GPT config, an independent single-process
reference written with plain torch (nn.Sequential + torch.optim.AdamW + clip_grad_norm_), and
worker functions run in forked ranks by `pipeexec.launch`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import pipesim
from pipeexec.config import TrainConfig
from pipeexec.data import BatchSource
from pipeexec.model import gpt_stack
from pipeexec.topology import destroy_topology, init_topology
from pipeexec.training.train import train
from pipeexec.run.assemble import assemble

GLOBAL_BATCH = 8
MICROBATCHES = 4
TINY = TrainConfig.from_flat(layers=6, hidden=16, heads=2, seq_len=8, vocab=32, steps=3, lr=3e-3,
                             warmup_steps=1, min_lr=3e-4, weight_decay=0.1, clip_grad=0.5,
                             p2p_timeout=60.0, collective_timeout=120.0, seed=7, device="cpu")


def layout_config(schedule: str, pp: int, dp: int, *, base: TrainConfig = TINY,
                  **changes) -> TrainConfig:
    """``base`` (TINY; its plan replaced by ``changes``' ``plan`` when given) with the
    schedule's largest workable vpp (2, else 1) and the fixed global batch, cut into
    MICROBATCHES microbatches or, for a schedule that needs more, the next count that divides it
    (see `choose_microbatches`)."""
    if "plan" in changes:
        base = base.replace(plan=changes.pop("plan"))
    m = changes.pop("microbatches", None) or choose_microbatches(schedule, pp, dp)
    if m is None:
        raise pipesim.ScheduleError(f"{schedule} builds with no microbatch count that divides "
                                    f"the global batch {GLOBAL_BATCH} over dp={dp} at pp={pp}")
    b = GLOBAL_BATCH // (dp * m)
    vpp = choose_vpp(schedule, pp, m)
    return base.with_flat(schedule=schedule, pp=pp, dp=dp, vpp=vpp, microbatches=m,
                          micro_batch_size=b, **changes)


def choose_microbatches(schedule: str, pp: int, dp: int) -> int | None:
    """MICROBATCHES, or 2x that for schedules that need more (dualpipev: m >= 2 pp), when the
    global batch still splits evenly; None when no count fits."""
    for m in (MICROBATCHES, 2 * MICROBATCHES):
        if GLOBAL_BATCH % (dp * m):
            continue
        try:
            choose_vpp(schedule, pp, m)
            return m
        except pipesim.ScheduleError:
            continue
    return None


def choose_vpp(schedule: str, pp: int, m: int) -> int:
    for vpp in (2, 1):
        try:
            pipesim.build_schedule(schedule, pp=pp, microbatches=m, vpp=vpp).validate()
            return vpp
        except pipesim.ScheduleError:
            continue
    raise pipesim.ScheduleError(f"{schedule} builds with neither vpp 2 nor 1 at pp={pp}, m={m}")


def mirrored(schedule: pipesim.Schedule) -> pipesim.Schedule:
    """The schedule with pipeline ranks renumbered r -> pp-1-r: a hand-made schedule with a
    custom placement (the first stage on the last rank), which no builder produces."""
    pp = schedule.pp
    return pipesim.Schedule(pp, schedule.vpp, schedule.num_microbatches,
                            tuple(pp - 1 - r for r in schedule.placement),
                            [schedule.compute_order(pp - 1 - r) for r in range(pp)],
                            name=f"mirrored {schedule.name}",
                            recv_lookahead=schedule.recv_lookahead).validate()


def reference_lr(cfg: TrainConfig, k: int) -> float:
    opt = cfg.optimizer
    if k < opt.warmup_steps:
        return opt.lr * (k + 1) / opt.warmup_steps
    t = (k - opt.warmup_steps) / max(1, opt.steps - opt.warmup_steps)
    return opt.min_lr + (opt.lr - opt.min_lr) * (1 + math.cos(math.pi * t)) / 2


def reference_model(cfg: TrainConfig) -> tuple[nn.Sequential, list[str]]:
    spec = gpt_stack(cfg.model)
    layers = [spec.build_layer(i, cfg.runtime.seed) for i in range(spec.num_layers)]
    if cfg.plan.model.tied_embeddings:          # one Parameter: the head is the embedding
        layers[-1].lm_head.weight = layers[0].tok
    model = nn.Sequential(*layers)
    names = [f"layers.{n}" for n, _ in model.named_parameters()]
    return model, names


@dataclass(frozen=True)
class ReferenceRun:
    """What the single-process reference gives: per step the loss and the global gradient
    norm before clipping (`torch.nn.utils.clip_grad_norm_`'s return; AdamW with clipping
    cancels a uniform scale of the gradients, the norm does not), the final parameters by
    name, the model, and per step the unclipped gradients by name."""

    losses: list[float]
    params: dict[str, torch.Tensor]
    model: nn.Module
    grad_norms: list[float]
    grads: list[dict[str, torch.Tensor]]


def reference_run(cfg: TrainConfig, steps: int | None = None,
                  dtype: torch.dtype = torch.float32) -> ReferenceRun:
    """Plain single-process training on the whole global batch (``cfg.clip_grad`` 0: no
    clipping, as the Trainer reads it)."""
    model, names = reference_model(cfg)
    params = list(model.parameters())
    masters = [p.detach().clone() for p in params]
    for m in masters:
        m.requires_grad_(True)
    if dtype != torch.float32:
        model.to(dtype)
    hyper = cfg.optimizer
    opt = torch.optim.AdamW(
        [{"params": [p for p in masters if p.dim() >= 2], "weight_decay": hyper.weight_decay},
         {"params": [p for p in masters if p.dim() < 2], "weight_decay": 0.0}],
        lr=hyper.lr, betas=(hyper.beta1, hyper.beta2), eps=hyper.eps)
    src = reference_batches(cfg)
    losses, norms, step_grads = [], [], []
    for k in range(cfg.optimizer.steps if steps is None else steps):
        x, y = src.global_batch_at(k)
        logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, cfg.plan.model.vocab), y.reshape(-1))
        grads = torch.autograd.grad(loss, params)
        for mp, g in zip(masters, grads):
            mp.grad = g.float()
        step_grads.append({n: mp.grad.clone() for n, mp in zip(names, masters)})
        if cfg.optimizer.clip_grad > 0:
            norm = torch.nn.utils.clip_grad_norm_(masters, cfg.optimizer.clip_grad)
        else:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(mp.grad)
                                                         for mp in masters]))
        norms.append(norm.item())
        for g in opt.param_groups:
            g["lr"] = reference_lr(cfg, k)
        opt.step()
        with torch.no_grad():
            for p, mp in zip(params, masters):
                p.copy_(mp)
        losses.append(loss.item())
    return ReferenceRun(losses, dict(zip(names, masters)), model, norms, step_grads)


def reference_train(cfg: TrainConfig, steps: int | None = None, dtype: torch.dtype = torch.float32,
                    norms: list[float] | None = None):
    """Plain single-process training on the whole global batch; returns losses, params, model
    (`reference_run` gives the gradient norms and gradients too; ``norms``: a list the steps'
    gradient norms before clipping are appended to)."""
    ref = reference_run(cfg, steps, dtype)
    if norms is not None:
        norms.extend(ref.grad_norms)
    return ref.losses, ref.params, ref.model


def assert_grad_norms(got, want, label: str = "", rtol: float = 1e-5) -> None:
    """The run's logged global gradient norm per step equals the reference's: catches a
    gradient scaled uniformly (summed instead of averaged over replicas), which losses and
    parameters cannot show once AdamW and clipping cancel the scale."""
    torch.testing.assert_close(torch.tensor(list(got), dtype=torch.float64),
                               torch.tensor(list(want), dtype=torch.float64), rtol=rtol, atol=0,
                               msg=lambda m: f"{label}: grad norms {list(got)} vs the "
                                             f"reference's {list(want)}: {m}")


def reference_batches(cfg: TrainConfig) -> BatchSource:
    """The batches ``cfg`` trains on (synthetic), whole: the single process's."""
    model = cfg.plan.model
    return BatchSource(seed=cfg.runtime.seed, seq_len=model.seq_length, vocab=model.vocab,
                       global_batch=cfg.global_batch)


def reference_logits(cfg: TrainConfig, model: nn.Module, step: int) -> torch.Tensor:
    x, _ = reference_batches(cfg).global_batch_at(step)
    with torch.no_grad():
        return model(x).float()


def layouts_worker(board, pp: int, dp: int, cases: list[tuple[str, dict]], device: str = "cpu") -> dict:
    """Train every case (schedule, config changes) on one topology; return what the rank holds
    (tensors moved to the CPU)."""
    topo = init_topology(pp, dp, device=device, timeout=120)
    out = {}
    try:
        for schedule, changes in cases:
            options = dict(changes)
            mirror = options.pop("mirror", False)
            cfg = layout_config(schedule, pp, dp, device=device, **options)
            custom = mirrored(cfg.build_schedule()) if mirror else None
            trainer = assemble(cfg, topo, board=board, schedule=custom)
            res = train(trainer)
            fwd = trainer.forward(cfg.optimizer.steps, keep_outputs=True)
            out[(schedule, tuple(sorted(changes.items())))] = {
                "losses": res.losses, "skipped": res.skipped, "loss_scales": res.loss_scales,
                "grad_norms": res.grad_norms,
                "params": {n: p.detach().cpu().clone() for n, p in trainer.named_parameters().items()},
                "fwd_outputs": {mb: t.cpu().clone() for mb, t in fwd.outputs.items()},
                "fwd_losses": {mb: t.item() for mb, t in fwd.losses.items()},
                "final_scale": trainer.scaler.scale,
                "pp_rank": topo.pp_rank, "dp_rank": topo.dp_rank, "vpp": cfg.plan.parallelism.vpp,
                "config": cfg,
            }
    finally:
        destroy_topology(topo)
    return out


def train_worker(board, config: TrainConfig) -> list[float]:
    """Train one config on a fresh topology; return the losses."""
    par, runtime = config.plan.parallelism, config.runtime
    topo = init_topology(par.pp, par.dp, backend=runtime.backend, device=runtime.device,
                         timeout=runtime.collective_timeout)
    try:
        return train(assemble(config, topo, board=board)).losses
    finally:
        destroy_topology(topo)


def state_worker(board, pp: int, dp: int, schedule: str, steps: int, state: dict | None) -> dict:
    """Load ``state`` (if any, from any layout), run ``steps`` more steps, return this rank's
    state dict and losses: the seam a checkpoint manager uses."""
    topo = init_topology(pp, dp, device="cpu", timeout=120)
    try:
        trainer = assemble(layout_config(schedule, pp, dp), topo, board=board)
        if state is not None:
            trainer.load_state_dict(state)
        losses = [trainer.step().loss for _ in range(steps)]
        return {"state": trainer.state_dict(), "losses": losses}
    finally:
        destroy_topology(topo)


def measured_peaks(configs: list[TrainConfig], stop: int = 2,
                   timeout: float = 300) -> list[list[float]]:
    """Each config's measured peak of held tensors per rank in step 1, the configs trained
    side by side in one job (`pipeexec.run.paired.paired_runs`, steps ``1..stop-1``
    profiled).

    Without the split probe: after the profiled steps it times each stage's F, B, I and W
    apart (calibration for zero-bubble schedules), half the job's CPU time, and the
    held-tensor meter is closed before it runs, so a peak is the same without it. One
    clock-alignment round, not 16: the offsets place the trace's times, which a peak does not
    read."""
    from pipeexec.measuring.profile_options import ProfileOptions
    from pipeexec.run.paired import paired_runs

    options = ProfileOptions(probe_split=False, align_rounds=1)
    runs = paired_runs(configs, 1, stop, timeout=timeout, profile=options)
    return [run.result(1).peak_memory for run in runs]


def merge_states(results: list[dict]) -> dict:
    """Union of the ranks' state dicts (entries are keyed by global parameter name)."""
    merged = {"model": {}, "optimizer": {}}
    for r in results:
        st = r["state"]
        merged["model"].update(st["model"])
        merged["optimizer"].update(st["optimizer"])
        for k in ("scaler", "iteration", "updates"):
            merged[k] = st[k]
    return merged
