"""The distributed optimizer: ZeRO stages 1, 2 and 3 over a data-parallel group.

`ShardedOptimizer` holds, for one rank's stages, what the Trainer otherwise keeps whole on every
data-parallel replica (the fp32 gradient buffer, the fp32 master weights, AdamW's moments) and
cuts it into ``d`` shards, one per rank of the group it is given (the data-parallel group;
later data x context parallel). Each stage's parameters live in one flat buffer of the compute
dtype, every parameter's ``.data`` a view of it, laid out as `pipeexec.training.flat` says: a
bucket per layer, each cut into ``d`` slices, shard ``r`` holding slice ``r`` of every bucket.
Megatron-LM's distributed optimizer semantics:

* ZeRO-1 (``level`` 1): the stages' full fp32 gradient buffer is kept for the step (the fp32
  parameters' ``.grad`` bound to it, as `ddp.GradBuffer`'s); after the step's backward each
  bucket is reduce-scattered (averaged) in place instead of all-reduced, each rank keeping its
  slices. Optimizer state and fp32 masters exist for the shard only: AdamW steps the pieces of
  parameters in the shard (`flat.Piece`: one flat tensor each, weight decay by the parameter
  it comes from: none for 1-d ones). Then every rank's updated slices are cast to the compute
  dtype and all-gathered into every rank's flat parameter buffer, bucket by bucket. In fp32
  the model parameters are the masters: the master pieces are slices of the parameter buffer.
* ZeRO-2: gradients sharded too, reduced as the plan's ``grad_reduce`` says
  (`pipesim.plan.parallelism.GRAD_REDUCE`). ``per_step`` (Megatron's, FSDP's under gradient
  accumulation, the default): autograd's gradients of every microbatch are accumulated into
  the stages' full fp32 buffer (ZeRO-1's), each taken from ``.grad`` by a post-accumulate
  hook, and once a stage's last backward action of the step has run its buckets are
  reduce-scattered in place, each rank keeping its slices (from then on the other slices are
  dead; the buffer is kept for the next step, as Megatron's). ``per_microbatch`` (DeepSpeed's
  stage 2): the rank keeps an fp32 shard accumulator for the step; a
  backward's gradients never form a whole-stage buffer: autograd adds each parameter's
  gradient into its ``.grad`` (unbound), a post-accumulate hook moves it into its bucket's
  fp32 buffer, allocated on the bucket's first gradient, and once the bucket has all of them
  it is reduce-scattered into the accumulator and freed (Megatron's and DeepSpeed's
  bucketed reduction, one bucket a layer); the REDUCE_GRAD after each B and W flushes buckets
  left incomplete (a few parameters' gradients from an I, unused parameters). So ZeRO-1
  reduce-scatters once a step and ZeRO-2 per microbatch once a microbatch, a bucket at a
  time, from each stage's B (or, split, its W, and an I with parameter gradients): the same
  collective, the gradient bytes times the microbatches, all inside the backward.
* ZeRO-3: parameters sharded too. A stage's flat parameter buffer is all-gathered from the
  shards before each of its F, B, I and W and released after (PyTorch FSDP1's trick: the
  buffer's storage is resized to 0 and back, and all-gathered into through ``.data``, so the
  views autograd saved in the forward stay valid and see the gathered values in the
  backward); gradients as ZeRO-2. The unit gathered is a stage: one stage's weights are whole
  during its actions (the more stages a rank holds, the smaller that is against its share).
  Its gradients are reduced per step or per microbatch as ZeRO-2's.

These are actions of the program the runtime runs (`pipesim.schedule.sharding` inserts
``UNSHARD s`` / ``RESHARD s`` around every compute of stage ``s`` under ZeRO-3 and
``REDUCE_GRAD s`` after its last backward, or after each B and W, under ZeRO-2/3; the
simulator times the same rows): the runtime calls `unshard`, `reshard` and `reduce_grad`
(``sharding`` is the `Sharding` to lower the schedule with). torch's FSDP2 (``fully_shard``) does not fit this runtime: it gathers and
reduces from module forward / backward hooks, but the runtime binds each fp32 parameter's
``.grad`` to a view of one flat gradient buffer and runs Zero Bubble's split backward (I, then
W later) by calling autograd on internal nodes of the graph (`pipeexec.pipeline.backward`),
which no module hook sees: W would run with the parameters released and its gradients never
reduced.

Gradient norm and loss scaling see the global norm: `local_grad_sq` is this rank's shard's
squared norm, to be summed over all ranks (not divided by ``d``, as replicated gradients are);
the Trainer's one all-reduce also makes every rank agree on an fp16 inf/nan skip.

Tied parameters (`pipeexec.training.tied`: a head tied to the embedding on another pipeline
rank, dualpipe's copies) keep their gradients whole: under ZeRO-1 the tied instances are summed
in the full gradient buffer before the reduce-scatter; under ZeRO-2/3 each bucket, before its
reduce-scatter, also adds its tied instances' gradients into a buffer of their own, kept for
the step, which after the backward is all-reduced over the group, summed over the instances
and written over the instances' pieces of the shard. Their gradients are thus not sharded (for
dualpipe, where every parameter is a copy, ZeRO-2/3 save no gradient memory); their weights
and optimizer state are. Duplicated instances count once in the norm, as without ZeRO.

State in and out is keyed by global parameter names with whole tensors (`full_masters`,
`full_optimizer_state` gather the shards; `load` slices), so checkpoints written under any
zero level and data-parallel size load under any other.

Expert parallelism (`ExpertShardedOptimizer`): a rank's experts are held by the dp x cp / ep
ranks of its expert-data-parallel group only, so they are sharded over that group (Megatron's
expert distributed optimizer) and the dense parameters over dp x cp, by two holders side by
side; the expert holder averages by dp x cp as the dense one (``divisor``: each expert
gradient already sums its whole ep group's tokens). Every rank of an expert-data-parallel group
is at the same pipeline rank, so either all of them hold experts or none does.
"""
from __future__ import annotations

import datetime
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipesim.schedule.sharding import Sharding

from .flat import Bucket, Piece, Slot, StageLayout, runs
from .optim import adamw_state_for, build_adamw, set_lr

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class ShardedOptimizer:
    """ZeRO ``level`` (1, 2 or 3) for the stages ``stages`` of one rank, sharded over ``group``
    (``shards`` ranks, this one ``rank``).

    Construction moves the parameters into flat buffers of ``dtype``; then the caller finds the
    tied parameters with `grad_view` as their gradients, makes their instances equal, and calls
    `start` (which makes the master shards from the values and, for ZeRO-3, releases the
    parameters).

    Per step: `zero`; the runtime's actions (this object its ``accumulate``, and for ZeRO-2/3
    the program's sharding actions, with ``grads_in_place``); `reduce_gradients`;
    `local_grad_sq` (into the caller's all-reduce); `step` unless the step is skipped.
    """

    def __init__(self, stages: Mapping[int, nn.Module], *, level: int, dtype: torch.dtype,
                 group: Any, shards: int, rank: int, device: torch.device, lr: float,
                 weight_decay: float, betas: tuple[float, float], eps: float,
                 timeout: float | None = None, divisor: int | None = None,
                 grad_reduce: str = "per_step") -> None:
        """``divisor``: the reduced gradients are divided by it (default: ``shards``, the
        group's average). ``grad_reduce``: ZeRO-2/3's reduction, ``per_step`` or
        ``per_microbatch`` (ZeRO-1 reduces once a step, after the backward, either way)."""
        if level not in (1, 2, 3):
            raise ValueError(f"ZeRO level must be 1, 2 or 3, got {level!r}")
        if grad_reduce not in ("per_step", "per_microbatch"):
            raise ValueError(f"grad_reduce must be per_step or per_microbatch, got "
                             f"{grad_reduce!r}")
        if shards > 1 and group is None:
            raise ValueError(f"{shards} shards need a process group")
        self.level, self.dtype, self.device = level, dtype, device
        self.group, self.shards, self.rank = group, shards, rank
        self.divisor = shards if divisor is None else divisor
        self.timeout = None if timeout is None else datetime.timedelta(seconds=timeout)
        self._hyper = dict(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
        self.params = {s: list(st.parameters()) for s, st in stages.items()}
        self.layouts = {s: StageLayout.of(s, [(n, tuple(p.shape)) for n, p in st.named_parameters()],
                                          shards, rank)
                        for s, st in stages.items()}
        self._slot_of = {id(p): (s, slot) for s, lay in self.layouts.items()
                         for slot, p in zip(lay.slots, self.params[s])}
        # ZeRO-1: autograd adds into the bound fp32 buffer (fp32 parameters only, as without
        # ZeRO); ZeRO-2/3: into each parameter's own .grad, which the post-accumulate hook
        # takes (any dtype): the runtime needs no binding (``owns_grads``)
        self.owns_grads = level >= 2
        self.grads_in_place = self.owns_grads or dtype == torch.float32
        # ZeRO-2/3: the program's UNSHARD / RESHARD / REDUCE_GRAD actions, which the runtime
        # runs through `unshard` / `reshard` / `reduce_grad` (`pipesim.schedule.sharding`)
        self.sharding = Sharding(level, grad_reduce) if level >= 2 else None
        self._master_is_param = dtype == torch.float32 and level < 3
        # the step's gradients whole (ZeRO-1, and ZeRO-2/3 reducing once a step) or a shard
        self.full_grads = level == 1 or grad_reduce == "per_step"
        self.grad_reduce = grad_reduce
        self._reduced: set[int] = set()             # stages reduce-scattered this step
        self.reduce_scatters = 0                    # bucket reduce-scatters this step
        self.param_flat: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for s, lay in self.layouts.items():
                flat = torch.zeros(lay.padded, dtype=dtype, device=device)
                for slot, p in zip(lay.slots, self.params[s]):
                    view = flat[slot.start: slot.stop].view(slot.shape)
                    view.copy_(p.detach())
                    p.data = view
                self.param_flat[s] = flat
        # gradients: ZeRO-1 the full buffers for the step (the shard is slices of them), else
        # a shard accumulator for the step and a buffer per bucket while it fills
        self.grad_full: dict[int, torch.Tensor] = {}
        self.grad_shard: dict[int, torch.Tensor] = {}
        if self.full_grads:
            self._grad_all = torch.zeros(sum(lay.padded for lay in self.layouts.values()),
                                         dtype=torch.float32, device=device)
            self.grad_full = _split(self._grad_all, {s: lay.padded for s, lay in self.layouts.items()})
        if level == 1:
            if dtype == torch.float32:
                for s, lay in self.layouts.items():
                    for slot, p in zip(lay.slots, self.params[s]):
                        p.grad = self.grad_full[s][slot.start: slot.stop].view(slot.shape)
        else:
            if not self.full_grads:
                self._grad_all = torch.zeros(sum(lay.shard_numel for lay in self.layouts.values()),
                                             dtype=torch.float32, device=device)
                self.grad_shard = _split(self._grad_all,
                                         {s: lay.shard_numel for s, lay in self.layouts.items()})
            for s, ps in self.params.items():
                for p in ps:
                    p.grad = None
                    p.register_post_accumulate_grad_hook(self._grad_ready)
        self._open: dict[tuple[int, int], torch.Tensor] = {}     # (stage, bucket) -> buffer
        self._count: dict[tuple[int, int], int] = {}
        self.tied = None
        self._tied_buf: torch.Tensor | None = None
        self._tied_of: dict[tuple[int, int], list[tuple[Slot, torch.Tensor]]] = {}
        self.optimizer: torch.optim.Optimizer | None = None

    def grad_view(self, param: torch.Tensor) -> torch.Tensor | None:
        """The whole gradient the tied-parameter reduction works on for ``param``: its view
        of the step's full gradient buffer (ZeRO-1); None under ZeRO-2/3, whose tied gradients
        get a buffer in `start`."""
        if self.level != 1:
            return None
        s, slot = self._slot_of[id(param)]
        return self.grad_full[s][slot.start: slot.stop].view(slot.shape)

    # -- start: masters, optimizer, norm ----------------------------------------------------
    @torch.no_grad()
    def start(self, tied=None) -> None:
        """Build the master shards from the parameters' values (after the tied instances were
        made equal), the optimizer over the shard's pieces and the norm's runs; ZeRO-3 then
        releases every stage's parameters. ``tied``: the `TiedParameters` of these stages."""
        self.tied = tied if tied else None
        duplicates: set[int] = set()
        if self.tied is not None:
            duplicates = {id(p) for p in self.tied.duplicate_params()}
            if self.level >= 2:
                found = [(id(p),) + self._slot_of[id(p)] for p in self.tied.params()]
                self._tied_buf = torch.zeros(sum(slot.numel for _, _, slot in found),
                                             dtype=torch.float32, device=self.device)
                views, offset = {}, 0
                for key, s, slot in found:
                    view = self._tied_buf[offset: offset + slot.numel].view(slot.shape)
                    offset += slot.numel
                    views[key] = view
                    self._tied_of.setdefault((s, slot.bucket), []).append((slot, view))
                self.tied.bind_grads(lambda p: views[id(p)])
        # fp32 below ZeRO-3: the parameters are the masters (pieces are slices of the buffer);
        # else an fp32 copy of the shard. ZeRO-3 keeps the compute-dtype shard to gather from.
        self.master: dict[int, torch.Tensor] = {}
        self.param_shard: dict[int, torch.Tensor] = {}
        for s, lay in self.layouts.items():
            if not self._master_is_param:
                self.master[s] = self._shard_of(s, self.param_flat[s]).float()
            if self.level == 3:
                self.param_shard[s] = (self.master[s] if self.dtype == torch.float32
                                       else self._shard_of(s, self.param_flat[s]))
        self.pieces: dict[int, tuple[Piece, ...]] = {s: lay.pieces() for s, lay in self.layouts.items()}
        self._segments: list[tuple[int, Piece, nn.Parameter]] = []
        named, decays = [], []
        for s, pieces in self.pieces.items():
            for piece in pieces:
                seg = nn.Parameter(self._master_piece(s, piece))
                seg.grad = self._grad_piece(s, piece)
                self._segments.append((s, piece, seg))
                named.append((f"{piece.slot.name}[{piece.lo}:{piece.hi}]", seg))
                decays.append(piece.slot.decay)
        self.optimizer = build_adamw(named, decays=decays, **self._hyper)
        # the norm: this shard's pieces of the parameters that count (not a tied duplicate),
        # contiguous ones as one run, in the gradient tensor they live in
        self._norm = {}
        for s, pieces in self.pieces.items():
            counted = [pc for pc in pieces if id(self.params[s][pc.slot.index]) not in duplicates]
            if self.full_grads:
                self._norm[s] = (self.grad_full[s], runs([(pc.flat, pc.flat + pc.numel)
                                                          for pc in counted]))
            else:
                self._norm[s] = (self.grad_shard[s], runs([(pc.offset, pc.offset + pc.numel)
                                                           for pc in counted]))
        if self.level == 3:
            for s in self.layouts:
                self._release(s)

    def _shard_of(self, s: int, flat: torch.Tensor) -> torch.Tensor:
        """A new tensor: this rank's slices of ``flat`` (a stage's flat buffer), in shard order."""
        lay = self.layouts[s]
        return torch.cat([flat[slice(*b.mine(self.rank))] for b in lay.buckets]).clone()

    def _master_piece(self, s: int, piece: Piece) -> torch.Tensor:
        if self._master_is_param:
            return self.param_flat[s][piece.flat: piece.flat + piece.numel]
        return self.master[s][piece.offset: piece.offset + piece.numel]

    def _grad_piece(self, s: int, piece: Piece) -> torch.Tensor:
        if self.full_grads:
            return self.grad_full[s][piece.flat: piece.flat + piece.numel]
        return self.grad_shard[s][piece.offset: piece.offset + piece.numel]

    # -- collectives --------------------------------------------------------------------------
    def _wait(self, works) -> None:
        for work in works:
            if work is None:
                continue
            if self.timeout is None:
                work.wait()
            else:
                work.wait(self.timeout)

    def _gather_into(self, s: int, flat: torch.Tensor, shard: torch.Tensor) -> None:
        """Every rank's ``shard`` (shard order) into ``flat`` (stage order), bucket by
        bucket; in place when ``shard``'s slices already lie in ``flat`` (``shard`` None)."""
        works = []
        for b in self.layouts[s].buckets:
            out = flat[b.start: b.start + b.padded]
            mine = (out[self.rank * b.slice: (self.rank + 1) * b.slice] if shard is None
                    else shard[b.shard_start: b.shard_start + b.slice])
            if self.shards > 1:
                works.append(_all_gather(out, mine, group=self.group, async_op=True))
            elif shard is not None:
                out.copy_(mine)
        self._wait(works)

    def _gather(self, s: int) -> None:
        """ZeRO-3: materialise stage ``s``'s flat parameter buffer from the shards."""
        flat = self.param_flat[s]
        storage = flat.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(flat.numel() * flat.element_size())
        # through .data: no version bump on the views autograd saved
        self._gather_into(s, flat.data, self.param_shard[s])

    def _release(self, s: int) -> None:
        self.param_flat[s].untyped_storage().resize_(0)

    def _reduce_scatter(self, full: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        """Sum a bucket's buffer ``full`` over the group in place; returns this rank's slice."""
        mine = full[self.rank * bucket.slice: (self.rank + 1) * bucket.slice]
        self.reduce_scatters += 1
        if self.shards > 1:
            self._wait([_reduce_scatter(mine, full, group=self.group, async_op=True)])
        return mine

    # -- the runtime's seams: accumulate, the post-accumulate hook, the stage hooks -----------
    def accumulate(self, stage: int, grads: Sequence[torch.Tensor | None]) -> None:
        """Add one backward's parameter gradients that autograd handed back (ZeRO-1 bf16/fp16;
        the few an I computes) into the stage's gradient buffer (ZeRO-2/3: their buckets)."""
        lay = self.layouts[stage]
        with torch.no_grad():
            for slot, g in zip(lay.slots, grads):
                if g is None:
                    continue
                self._add(stage, slot, g)

    def _grad_ready(self, param: torch.Tensor) -> None:
        """Post-accumulate hook (ZeRO-2/3): take the gradient autograd just put in ``.grad``."""
        grad, param.grad = param.grad, None
        s, slot = self._slot_of[id(param)]
        with torch.no_grad():
            self._add(s, slot, grad)

    def _add(self, s: int, slot: Slot, grad: torch.Tensor) -> None:
        if self.full_grads:             # accumulated whole, reduced once a step
            self.grad_full[s][slot.start: slot.stop].view(slot.shape).add_(grad)
            return
        key = (s, slot.bucket)
        bucket = self.layouts[s].buckets[slot.bucket]
        buf = self._open.get(key)
        if buf is None:
            buf = self._open[key] = torch.zeros(bucket.padded, dtype=torch.float32,
                                                device=self.device)
            self._count[key] = 0
        at = slot.start - bucket.start
        buf[at: at + slot.numel].add_(grad.reshape(-1))
        self._count[key] += 1
        if self._count[key] == bucket.params:
            self._reduce_bucket(s, slot.bucket)

    def _reduce_bucket(self, s: int, b: int) -> None:
        """Reduce-scatter one bucket's gradients into the shard accumulator and free it."""
        key = (s, b)
        buf = self._open.pop(key)
        del self._count[key]
        bucket = self.layouts[s].buckets[b]
        for slot, whole in self._tied_of.get(key, ()):
            at = slot.start - bucket.start
            whole.add_(buf[at: at + slot.numel].view(slot.shape))
        mine = self._reduce_scatter(buf, bucket)
        self.grad_shard[s][bucket.shard_start: bucket.shard_start + bucket.slice].add_(mine)

    def _reduce_stage(self, s: int) -> None:
        """Once a step: stage ``s``'s whole buffer reduce-scattered in place, bucket by bucket
        (ZeRO-2/3 first copy the tied instances' gradients out, as the per-microbatch
        buckets do)."""
        full = self.grad_full[s]
        for b, bucket in enumerate(self.layouts[s].buckets):
            buf = full[bucket.start: bucket.start + bucket.padded]
            for slot, whole in self._tied_of.get((s, b), ()):
                at = slot.start - bucket.start
                whole.add_(buf[at: at + slot.numel].view(slot.shape))
            self._reduce_scatter(buf, bucket)
        self._reduced.add(s)

    # -- the program's sharding actions (`pipesim.schedule.sharding`) ------------------------
    def unshard(self, stage: int) -> None:
        """UNSHARD: ZeRO-3 gathers the stage's parameters whole (collective over the group)."""
        if self.level == 3:
            self._gather(stage)

    def reshard(self, stage: int) -> None:
        """RESHARD: ZeRO-3 releases the stage's gathered parameters (no communication)."""
        if self.level == 3:
            self._release(stage)

    @torch.no_grad()
    def reduce_grad(self, stage: int) -> None:
        """REDUCE_GRAD: ZeRO-2/3 reduce-scatter the stage's gradients. Once a step: its whole
        buffer, bucket by bucket (after its last backward); once a microbatch: the buckets the
        backward left incomplete, in bucket order, the same on every rank (complete ones were
        reduced as they filled)."""
        if self.level < 2:
            return
        if self.full_grads:
            if stage not in self._reduced:
                self._reduce_stage(stage)
        else:
            for key in sorted(k for k in self._open if k[0] == stage):
                self._reduce_bucket(*key)

    # -- the same as stage hooks, for a stage run outside a program (one-process tests) --------
    # -- the step -----------------------------------------------------------------------------
    def zero(self) -> None:
        """Start of a step: no gradient yet."""
        self._grad_all.zero_()
        self._reduced.clear()
        self.reduce_scatters = 0
        if self._tied_buf is not None:
            self._tied_buf.zero_()

    def _my_grads(self) -> list[torch.Tensor]:
        """The gradient tensors of this rank's shard (ZeRO-1: its slices of every bucket)."""
        if not self.full_grads:
            return [self._grad_all]
        return [self.grad_full[s][slice(*b.mine(self.rank))]
                for s, lay in self.layouts.items() for b in lay.buckets]

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """After the step's backward: every shard holds the group's average gradient (tied
        instances summed first)."""
        if self.level == 1:
            if self.tied is not None:
                self.tied.reduce()
            for s, lay in self.layouts.items():
                for b in lay.buckets:
                    self._reduce_scatter(self.grad_full[s][b.start: b.start + b.padded], b)
        elif self.full_grads:           # stages whose last backward did not reduce them
            for s in self.layouts:
                if s not in self._reduced:
                    self._reduce_stage(s)
        if self.divisor > 1:
            for g in self._my_grads():
                g.div_(self.divisor)
        if self._tied_buf is not None:
            if self.shards > 1:
                self._wait([dist.all_reduce(self._tied_buf, group=self.group, async_op=True)])
                self._tied_buf.div_(self.shards)
            self.tied.reduce()
            for (s, _), slots in self._tied_of.items():
                mine = {pc.slot.index: pc for pc in self.pieces[s]}
                for slot, whole in slots:
                    pc = mine.get(slot.index)
                    if pc is not None:
                        self._grad_piece(s, pc).copy_(whole.reshape(-1)[pc.lo: pc.hi])

    def grad_pieces(self, param: torch.Tensor) -> list[torch.Tensor]:
        """After `reduce_gradients`: this rank's pieces of ``param``'s reduced gradient (none
        when its shard holds none of it), for what works on a parameter's gradient across
        another group (tensor parallelism's sum of sequence-parallel gradients, its norm rule)."""
        s, slot = self._slot_of[id(param)]
        return [self._grad_piece(s, pc) for pc in self.pieces[s] if pc.slot.index == slot.index]

    def local_grad_sq(self, minus: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's share of the squared global gradient norm: its shard's pieces of the
        parameters that count (a tied parameter once). Summed over every rank (one
        all-reduce, not divided by the shards) it is the squared norm of the model's gradient.
        The one place the norm is computed. ``minus``: the squared norm of gradients in the
        shard that count on another rank (tensor parallelism's replicated parameters)."""
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for g, rs in self._norm.values():
            for a, b in rs:
                sq = sq + torch.dot(g[a:b], g[a:b])
        return sq if minus is None else sq - minus

    def poison(self) -> None:
        """Fault injection: an inf in this rank's gradient (the fp16 skip path)."""
        for g, rs in self._norm.values():
            if rs:
                g[rs[0][0]] = float("inf")
                return

    @torch.no_grad()
    def step(self, grad_scale: float, lr: float) -> None:
        """Scale the shard's gradients (clipping and loss scale), step AdamW on the shard and
        publish the new weights: all-gathered into every rank's parameters (ZeRO-1/2), or into
        the compute-dtype shard the next gathers read (ZeRO-3)."""
        for g in self._my_grads():
            g.mul_(grad_scale)
        set_lr(self.optimizer, lr)
        self.optimizer.step()
        if self.level == 3:
            if self.dtype != torch.float32:
                for s, shard in self.param_shard.items():
                    shard.copy_(self.master[s])
            return
        for s, lay in self.layouts.items():
            flat = self.param_flat[s]
            if not self._master_is_param:
                for b in lay.buckets:
                    flat[slice(*b.mine(self.rank))].copy_(
                        self.master[s][b.shard_start: b.shard_start + b.slice])
            self._gather_into(s, flat.data, None)

    # -- state by global names, whole tensors --------------------------------------------------
    def _whole(self, shards: Mapping[int, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Collective: the group's fp32 ``shards`` (per stage, shard order) gathered, by
        global parameter name."""
        full = {}
        for s, lay in self.layouts.items():
            full[s] = torch.zeros(lay.padded, dtype=torch.float32, device=self.device)
            self._gather_into(s, full[s], shards[s].float())
        return self._by_name(full)

    def _by_name(self, full: Mapping[int, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {slot.name: full[s][slot.start: slot.stop].view(slot.shape).float().clone()
                for s, lay in self.layouts.items() for slot in lay.slots}

    @torch.no_grad()
    def full_masters(self) -> dict[str, torch.Tensor]:
        """fp32 master weights by global name, whole. Collective over the group (except fp32
        below ZeRO-3, whose parameters are the masters and whole on every rank)."""
        if self._master_is_param:
            return self._by_name(self.param_flat)
        return self._whole(self.master)

    @torch.no_grad()
    def full_optimizer_state(self) -> dict[str, dict[str, Any]]:
        """AdamW's state by global name, whole tensors (none before the first update), as
        ``torch.optim.AdamW`` keeps it for a whole parameter. Collective over the group."""
        keys = ("exp_avg", "exp_avg_sq")
        moments = {k: {s: torch.zeros(lay.shard_numel, dtype=torch.float32, device=self.device)
                       for s, lay in self.layouts.items()} for k in keys}
        step = None
        for s, piece, seg in self._segments:
            st = self.optimizer.state.get(seg)
            if not st:
                continue
            step = st["step"]
            for k in keys:
                moments[k][s][piece.offset: piece.offset + piece.numel].copy_(st[k])
        count = torch.tensor([0.0 if step is None else float(step)], device=self.device)
        if self.shards > 1:
            self._wait([dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.group,
                                        async_op=True)])
        whole = {k: self._whole(moments[k]) for k in keys}
        if count.item() == 0:
            return {}
        if step is None:                 # (a rank whose shard holds no parameter)
            step = torch.tensor(count.item(), dtype=torch.float32)
        return {name: {"step": step.detach().clone(), **{k: whole[k][name] for k in keys}}
                for name in whole[keys[0]]}

    @torch.no_grad()
    def load(self, model: Mapping[str, torch.Tensor],
             optimizer: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        """Whole fp32 tensors by global name (any layout may have written them) into the
        parameters and this rank's shards; ``optimizer``: AdamW states by name (whole)."""
        for s, lay in self.layouts.items():
            full = torch.zeros(lay.padded, dtype=torch.float32, device=self.device)
            for slot in lay.slots:
                full[slot.start: slot.stop].copy_(model[slot.name].reshape(-1))
            if self.level < 3:
                self.param_flat[s].copy_(full)
            if not self._master_is_param:
                self.master[s].copy_(self._shard_of(s, full))
            if self.level == 3 and self.dtype != torch.float32:
                self.param_shard[s].copy_(self.master[s])
        if optimizer is None:
            return
        for s, piece, seg in self._segments:
            st = optimizer.get(piece.slot.name)
            if st is None:
                continue
            sliced = {k: (v.reshape(-1)[piece.lo: piece.hi] if torch.is_tensor(v) and v.dim() > 0
                          else v) for k, v in st.items()}
            self.optimizer.state[seg] = adamw_state_for(self.optimizer, seg, sliced)

    # -- what it holds (memory meters), and whole weights for a while --------------------------
    def held_tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor of the training state this object holds now: parameter buffers (a
        released ZeRO-3 buffer has an empty storage), gradient buffers and shards (and any
        bucket filling), masters, AdamW's moments."""
        yield from self.param_flat.values()
        yield self._grad_all
        yield from self._open.values()
        if self._tied_buf is not None:
            yield self._tied_buf
        yield from self.master.values()
        yield from self.param_shard.values()
        for st in self.optimizer.state.values():
            yield from (v for v in st.values() if torch.is_tensor(v))

    def gather_all(self) -> None:
        """ZeRO-3: gather every stage's parameters (collective over the group), until
        `release_all`: for code that runs the stages outside the runtime (the split-backward
        probe)."""
        if self.level == 3:
            for s in self.layouts:
                self._gather(s)

    def release_all(self) -> None:
        if self.level == 3:
            for s in self.layouts:
                self._release(s)


class _Subset(nn.Module):
    """The parameters of ``module`` that ``keep`` picks, in its order, names kept (a holder's
    view of a stage). Not called: it only lists parameters."""

    def __init__(self, module: nn.Module, keep) -> None:
        super().__init__()
        object.__setattr__(self, "_named", [(n, p) for n, p in module.named_parameters()
                                            if keep(p)])

    def named_parameters(self, *args, **kwargs):      # noqa: D102
        return iter(self._named)

    def parameters(self, *args, **kwargs):            # noqa: D102
        return iter(p for _, p in self._named)


class ExpertShardedOptimizer:
    """ZeRO under expert parallelism: the dense parameters sharded over ``dense_group``
    (dp x cp), the expert ones (``is_expert``) over ``expert_group`` (the expert-data-parallel
    group, ``expert_shards`` ranks), both averaged by ``dense_shards``; the one holder the
    Trainer sees (the `ShardedOptimizer` interface, delegated)."""

    def __init__(self, stages: Mapping[int, nn.Module], *, is_expert, level: int,
                 dtype: torch.dtype, dense_group: Any, dense_shards: int, dense_rank: int,
                 expert_group: Any, expert_shards: int, expert_rank: int,
                 device: torch.device, **hyper: Any) -> None:
        dense = {s: _Subset(st, lambda p: not is_expert(p)) for s, st in stages.items()}
        experts = {s: _Subset(st, is_expert) for s, st in stages.items()}
        self.is_expert = is_expert
        self.dense = ShardedOptimizer(dense, level=level, dtype=dtype, group=dense_group,
                                      shards=dense_shards, rank=dense_rank, device=device,
                                      **hyper)
        has_experts = any(True for st in experts.values() for _ in st.parameters())
        self.expert = (ShardedOptimizer(experts, level=level, dtype=dtype, group=expert_group,
                                        shards=expert_shards, rank=expert_rank, device=device,
                                        divisor=dense_shards, **hyper)
                       if has_experts else None)
        self.holders = [h for h in (self.dense, self.expert) if h is not None]
        self.level, self.owns_grads = level, self.dense.owns_grads
        self.grads_in_place = self.dense.grads_in_place
        self.sharding = self.dense.sharding
        self._mask = {s: [is_expert(p) for p in st.parameters()] for s, st in stages.items()}

    def _of(self, param: torch.Tensor) -> ShardedOptimizer:
        return self.expert if self.is_expert(param) else self.dense

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.dense.optimizer

    def grad_view(self, param: torch.Tensor) -> torch.Tensor | None:
        return self._of(param).grad_view(param)

    def start(self, tied=None) -> None:
        self.dense.start(tied)          # tied parameters are dense (embedding and head)
        if self.expert is not None:
            self.expert.start(None)

    def accumulate(self, stage: int, grads: Sequence[torch.Tensor | None]) -> None:
        mask = self._mask[stage]
        self.dense.accumulate(stage, [g for g, e in zip(grads, mask) if not e])
        if self.expert is not None:
            self.expert.accumulate(stage, [g for g, e in zip(grads, mask) if e])

    def unshard(self, stage: int) -> None:
        for h in self.holders:
            h.unshard(stage)

    def reshard(self, stage: int) -> None:
        for h in self.holders:
            h.reshard(stage)

    def reduce_grad(self, stage: int) -> None:
        for h in self.holders:
            h.reduce_grad(stage)

    def zero(self) -> None:
        for h in self.holders:
            h.zero()

    def reduce_gradients(self) -> None:
        for h in self.holders:
            h.reduce_gradients()

    def grad_pieces(self, param: torch.Tensor) -> list[torch.Tensor]:
        return self._of(param).grad_pieces(param)

    def local_grad_sq(self, minus: torch.Tensor | None = None) -> torch.Tensor:
        """Each expert counted once: its pieces are cut over its expert-data-parallel group,
        and the ep groups' ranks hold different experts."""
        sq = sum((h.local_grad_sq() for h in self.holders[1:]), self.dense.local_grad_sq())
        return sq if minus is None else sq - minus

    def poison(self) -> None:
        self.dense.poison()

    def step(self, grad_scale: float, lr: float) -> None:
        for h in self.holders:
            h.step(grad_scale, lr)

    def full_masters(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for h in self.holders:
            out.update(h.full_masters())
        return out

    def full_optimizer_state(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for h in self.holders:
            out.update(h.full_optimizer_state())
        return out

    def load(self, model: Mapping[str, torch.Tensor],
             optimizer: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        for h in self.holders:
            h.load(model, optimizer)

    def held_tensors(self) -> Iterator[torch.Tensor]:
        for h in self.holders:
            yield from h.held_tensors()

    def gather_all(self) -> None:
        for h in self.holders:
            h.gather_all()

    def release_all(self) -> None:
        for h in self.holders:
            h.release_all()


def _split(flat: torch.Tensor, sizes: Mapping[int, int]) -> dict[int, torch.Tensor]:
    """Consecutive views of ``flat``, of the given sizes, by key."""
    out, offset = {}, 0
    for s, n in sizes.items():
        out[s] = flat[offset: offset + n]
        offset += n
    return out
