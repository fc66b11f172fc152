"""The action interpreter: one rank walks ``schedule.actions(rank)`` and does exactly that.

Every op maps to one method (DeepSpeed's instruction -> method idea, without its lock-step);
there is no per-schedule code and no branching on the schedule's name. What the methods share is
a few dictionaries keyed by ``(stage, microbatch)``:

* ``_inputs``   stage input kept for backward (a leaf that requires grad, or None on stage 0)
* ``_roots``    gradient edge of the stage output (or of the scaled loss on the last stage)
* ``_outputs``  forward output waiting for SEND_F (dropped once sent: its storage is freed when
  the send completes unless the graph saved it; Megatron's deallocate-output idea, without
  keeping a placeholder tensor because backward starts from the gradient edge). With
  ``deallocate_outputs=False`` it is kept in ``_kept`` until the stage's backward instead.
* ``_meta``     output shape and dtype, for the RECV_B buffer
* ``_grads``    gradient of the stage output (received, or handed over by a local next stage)
* ``_fwd``      input handed over by a local previous stage (the turn of a V)
* ``_dx``       input gradient waiting for SEND_B
* ``_wgrad``    what W needs after I

Observers are the per-action seams (the profiler's timer and memory meter, the launcher's
progress board, fault injection): objects with any of ``start(action, step)``,
``end(action, step)``, ``wait_start(recv_action, step)`` / ``wait_end(recv_action, step)``
(around the wait for a received tensor, inside the compute action that uses it) and
``message(action, nbytes)`` (a send or a receive buffer posted inside ``action``). The runtime
calls them; none reaches into the runtime (the held tensors are public: `held_state`). Any
exception is re-raised as `PipelineError` naming the rank and the action.

Stage hooks (`StageHooks`, ``stage_hooks=``) are the other seam, for work that must happen
around a stage's computation rather than be watched: ``before(action)`` / ``after(action)``
around every F, B, I and W (each part of an ``OVERLAP_F_B`` on its own), inside the observers'
``start`` / ``end`` (so a profiled action's time includes the hooks' work, e.g. a collective).
Several hook objects run ``before`` in their order and ``after`` in reverse.

ZeRO is actions of the program (`pipesim.schedule.sharding`): ``UNSHARD`` / ``RESHARD`` /
``REDUCE_GRAD`` of a stage, each one method here calling the ``sharding`` object's
``unshard(stage)`` / ``reshard(stage)`` / ``reduce_grad(stage)`` (the ZeRO holder,
`pipeexec.training.zero`: it gathers a stage's parameters and releases them, and
reduce-scatters its gradients; its post-accumulate hooks take each gradient autograd puts in
``.grad``). The observers see them as any action. A hook or sharding object whose
``owns_grads`` is true takes every gradient autograd accumulates into a parameter's ``.grad``,
so under ``grads_in_place`` the runtime neither requires nor checks a ``.grad`` bound to a
buffer between actions.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch.autograd.graph import get_gradient_edge

from pipesim.schedule.action import (B, F, I, OVERLAP_F_B, RECV_B, RECV_F, REDUCE_GRAD, RESHARD,
                                     SEND_B, SEND_F, SHARD_OPS, UNSHARD, W, Action)

from .backward import backward_input, full_backward
from .p2p import BWD, FWD, P2P, P2PError
from .stage import Stage


class PipelineError(RuntimeError):
    """An action failed on this rank; the message names the rank, the action and the step."""

    def __init__(self, message: str, rank: int, action: str, step: int) -> None:
        super().__init__(message)
        self.rank, self.action, self.step = rank, action, step


class ActionObserver(Protocol):
    """Hooks the runtime calls (each optional): ``start`` / ``end`` around every action,
    ``wait_start`` / ``wait_end`` around a receive wait, ``message`` with the bytes of a send or
    receive posted. An ``OVERLAP_F_B`` comes as ``start(overlap)``, then start/end of each of
    its parts, then ``end(overlap)``."""

    def start(self, action: Action, step: int) -> None: ...
    def end(self, action: Action, step: int) -> None: ...


class StageHooks(Protocol):
    """Work around one stage's computation: ``before(action)`` right before, ``after(action)``
    right after every F, B, I or W of ``action.stage`` on this rank (the forward-only runtime's
    F included). ``owns_grads``: the hooks take every gradient autograd accumulates into a
    parameter's ``.grad`` (``grads_in_place`` with no buffer bound between actions)."""

    owns_grads: bool

    def before(self, action: Action) -> None: ...
    def after(self, action: Action) -> None: ...


class ShardingOps(Protocol):
    """What the program's sharding actions do, on one stage (the ZeRO holder)."""

    owns_grads: bool

    def unshard(self, stage: int) -> None: ...
    def reshard(self, stage: int) -> None: ...
    def reduce_grad(self, stage: int) -> None: ...


_COMPUTE_OPS = frozenset((F, B, I, W))


class InjectedFault(RuntimeError):
    """Raised by fault injection (tests of the failure paths)."""


@dataclass
class StepOutput:
    losses: dict[int, torch.Tensor] = field(default_factory=dict)    # microbatch -> loss (last stage)
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)   # forward-only, if kept


class PipelineRuntime:
    """Runs one rank's actions of a schedule for one step.

    ``stages``: this rank's stages by global stage index. ``accumulate(stage, grads)`` adds the
    parameter gradients of one backward (B or W; I adds those few it computes) to wherever the
    caller keeps them (fp32 main grads). With ``grads_in_place`` (fp32 parameters whose
    ``.grad`` the caller has bound to those main grads, see `GradBuffer.bind`), B and W let
    autograd add into ``.grad`` directly instead.
    """

    def __init__(self, schedule, pp_rank: int, stages: dict[int, Stage],
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 accumulate: Callable[[int, Sequence[torch.Tensor | None]], None],
                 p2p: P2P | None, *, global_rank: int, device: torch.device,
                 compute_dtype: torch.dtype = torch.float32,
                 observers: Sequence[ActionObserver] = (),
                 deallocate_outputs: bool = True, grads_in_place: bool = False,
                 stage_hooks: Sequence[StageHooks] = (),
                 sharding: ShardingOps | None = None) -> None:
        """``sharding``: runs the schedule's UNSHARD / RESHARD / REDUCE_GRAD actions (needed
        when it has any)."""
        self.schedule = schedule
        self.pp_rank = pp_rank
        self.global_rank = global_rank
        self.stages = stages
        self.params = {s: [p for p in st.parameters()] for s, st in stages.items()}
        self.loss_fn = loss_fn
        self.accumulate = accumulate
        self.p2p = p2p
        self.device = device
        self.compute_dtype = compute_dtype
        self.observers: list[ActionObserver] = []
        self._hooks()
        for obs in observers:
            self.add_observer(obs)
        self.deallocate_outputs = deallocate_outputs
        self.grads_in_place = grads_in_place
        self.stage_hooks = tuple(stage_hooks)
        self._before = tuple(h.before for h in self.stage_hooks)
        self._after = tuple(h.after for h in self.stage_hooks)[::-1]
        self._bound: list = []
        self.sharding = sharding
        hooks_own = any(getattr(h, "owns_grads", False)
                        for h in (*self.stage_hooks, sharding) if h is not None)
        if grads_in_place and not hooks_own:
            _check_bound_grads(self.params, global_rank)
            self._bound = [(s, k, p, p.grad) for s, ps in self.params.items()
                           for k, p in enumerate(ps)]
        self.actions = schedule.actions(pp_rank)
        self.placement = schedule.placement
        self.num_stages = schedule.num_stages
        self.m = schedule.num_microbatches
        # Where each microbatch is fed and where its loss is taken (its route's first and last
        # stage: stage 0 and the last stage unless the schedule routes microbatches, as dualpipe)
        self._first = [schedule.first_stage(mb) for mb in range(self.m)]
        self._last = [schedule.last_stage(mb) for mb in range(self.m)]
        for a in self.actions:
            if a.stage not in stages:
                raise PipelineError(f"rank {global_rank}: schedule gives action {a} for stage "
                                    f"{a.stage}, which this rank does not hold "
                                    f"(holds {sorted(stages)})", global_rank, str(a), -1)
            if a.op in SHARD_OPS and sharding is None:
                raise PipelineError(f"rank {global_rank}: schedule gives action {a}, and the "
                                    "runtime has no sharding (a ZeRO holder) to run it",
                                    global_rank, str(a), -1)
        self._ops = {F: self._forward, B: self._backward, I: self._backward_input,
                     W: self._backward_weight, SEND_F: self._send_forward,
                     RECV_F: self._recv_forward, SEND_B: self._send_backward,
                     RECV_B: self._recv_backward, OVERLAP_F_B: self._overlapped,
                     UNSHARD: self._unshard, RESHARD: self._reshard,
                     REDUCE_GRAD: self._reduce_grad}
        if self.stage_hooks:
            for op in _COMPUTE_OPS:
                self._ops[op] = self._hooked(op, self._ops[op])

    def _hooked(self, op: str, method: Callable[[int, int], None]) -> Callable[[int, int], None]:
        """``method`` with the stage hooks around it."""
        before, after = self._before, self._after

        def run(s: int, mb: int) -> None:
            action = Action(op, s, mb)
            for hook in before:
                hook(action)
            method(s, mb)
            for hook in after:
                hook(action)
        return run

    # -- observers ---------------------------------------------------------------------------
    def add_observer(self, observer: ActionObserver) -> None:
        """Call ``observer``'s hooks from the next action on (once, however often added)."""
        if observer not in self.observers:
            self.observers.append(observer)
            self._hooks()

    def remove_observer(self, observer: ActionObserver) -> None:
        self.observers.remove(observer)
        self._hooks()

    def _hooks(self) -> None:
        """Bound hook methods per kind, in the observers' order (ends in reverse: nesting)."""
        def bound(name: str) -> tuple:
            return tuple(getattr(o, name) for o in self.observers if hasattr(o, name))
        self._on_start, self._on_wait_start, self._on_wait_end, self._on_message = (
            bound("start"), bound("wait_start"), bound("wait_end"), bound("message"))
        self._on_end = bound("end")[::-1]

    def held_state(self) -> tuple[dict, ...]:
        """The dictionaries of tensors this rank holds between actions (stage inputs, outputs
        waiting to be sent or kept, posted receives, gradients waiting, W's state): what a
        memory meter counts besides autograd's saved tensors. Empty outside a step."""
        return tuple(self.__dict__.get(name) or {} for name in
                     ("_inputs", "_outputs", "_kept", "_grads", "_fwd", "_dx", "_wgrad", "_recvs"))

    # -- one step ---------------------------------------------------------------------------
    def run(self, microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]], *, step: int = 0,
            loss_scale: float = 1.0, forward_only: bool = False, keep_outputs: bool = False
            ) -> StepOutput:
        """Execute this rank's actions for one step; returns the last stage's microbatch losses."""
        if len(microbatches) != self.m:
            raise ValueError(f"rank {self.global_rank}: got {len(microbatches)} microbatches, "
                             f"the schedule has {self.m}")
        self._mbs = microbatches
        self._scale = loss_scale / self.m
        self._forward_only = forward_only or self.schedule.forward_only
        self._keep = keep_outputs
        self._out = StepOutput()
        self._inputs: dict = {}
        self._roots: dict = {}
        self._outputs: dict = {}
        self._meta: dict = {}
        self._grads: dict = {}
        self._fwd: dict = {}
        self._dx: dict = {}
        self._wgrad: dict = {}
        self._recvs: dict = {}
        self._kept: dict = {}
        self._step = step
        for s, k, p, g in self._bound:
            if p.grad is not g:      # autograd would accumulate somewhere the caller never reads
                raise PipelineError(f"rank {self.global_rank}: stage {s} parameter {k}: its .grad "
                                    "was replaced since the runtime was built with "
                                    "grads_in_place (it must stay bound to the gradient buffer)",
                                    self.global_rank, "start", step)
        ops, rank = self._ops, self.global_rank
        starts, ends = self._on_start, self._on_end
        action = None
        try:
            for action in self.actions:
                op, stage, mb = action
                for hook in starts:
                    hook(action, step)
                ops[op](stage, mb)
                for hook in ends:
                    hook(action, step)
            action = None
            if self.p2p is not None:
                self.p2p.wait_sends()
            self._check_drained()
        except PipelineError:
            raise
        except Exception as exc:
            where = f"action {action}" if action is not None else "the end of the step"
            raise PipelineError(f"rank {rank} (pp rank {self.pp_rank}) failed in {where} of step "
                                f"{step}: {type(exc).__name__}: {exc}", rank,
                                str(action) if action is not None else "end", step) from exc
        finally:
            self._mbs = None
        return self._out

    def _check_drained(self) -> None:
        left = {name: d for name, d in (("inputs", self._inputs), ("gradients", self._grads),
                                         ("weight gradients", self._wgrad), ("receives", self._recvs))
                if d}
        if left and not self._forward_only:
            detail = "; ".join(f"{k}: {sorted(v)}" for k, v in left.items())
            raise RuntimeError(f"state left over after the last action ({detail})")

    # -- helpers ----------------------------------------------------------------------------
    def _wait(self, pending) -> torch.Tensor:
        if not self._on_wait_start and not self._on_wait_end:
            return self.p2p.wait(pending)
        for hook in self._on_wait_start:
            hook(pending.action, self._step)
        tensor = self.p2p.wait(pending)
        for hook in self._on_wait_end:
            hook(pending.action, self._step)
        return tensor

    def _posted(self, action: Action, tensor: torch.Tensor | None) -> None:
        """Tell the observers the bytes of a send or receive buffer posted in ``action`` (a
        boundary's first activation is posted only when waited for, its shape arriving with
        it: no bytes then)."""
        if tensor is not None:
            for hook in self._on_message:
                hook(action, tensor.nelement() * tensor.element_size())

    def _local(self, stage: int) -> bool:
        return self.placement[stage] == self.pp_rank

    # -- forward ----------------------------------------------------------------------------
    def _forward(self, s: int, mb: int) -> None:
        stage = self.stages[s]
        key = (s, mb)
        first = s == self._first[mb]
        if first:
            x = self._mbs[mb][0]
            x = x.to(self.device, non_blocking=x.is_pinned())   # async only from pinned memory
            if x.is_floating_point():
                x = x.to(self.compute_dtype)   # Float16Module: cast inputs on the first stage
        elif key in self._fwd:
            x = self._fwd.pop(key)
        else:
            pending = self._recvs.pop((RECV_F, s, mb), None)
            if pending is None:
                raise RuntimeError(f"stage {s} microbatch {mb}: no input (no RECV_F posted and the "
                                   "previous stage is not on this rank)")
            x = self._wait(pending)
        train = not self._forward_only
        if train and x.is_floating_point() and not first:
            x.requires_grad_(True)
        with torch.set_grad_enabled(train):
            y = stage(x)
            if s == self._last[mb]:
                t = self._mbs[mb][1]
                loss = self.loss_fn(y.float(), t.to(self.device, non_blocking=t.is_pinned()))
                self._out.losses[mb] = loss.detach()
                if self._keep:
                    self._out.outputs[mb] = y.detach().float()
                if train:
                    self._roots[key] = get_gradient_edge(loss * self._scale)
                    self._inputs[key] = x if x.requires_grad else None
                return
        if train:
            self._roots[key] = get_gradient_edge(y)
            self._inputs[key] = x if x.requires_grad else None
            self._meta[key] = (y.shape, y.dtype)
        if self._local(s + 1):
            self._fwd[(s + 1, mb)] = y.detach() if train else y
        else:
            self._outputs[key] = y

    def _send_forward(self, s: int, mb: int) -> None:
        y = self._outputs.pop((s, mb))
        action = Action(SEND_F, s, mb)
        self._posted(action, y)
        self.p2p.send(y.detach(), self.placement[s + 1], FWD, s, mb, action)
        if not self.deallocate_outputs and not self._forward_only:
            self._kept[(s, mb)] = y     # held until the backward, as without the trick

    def _recv_forward(self, s: int, mb: int) -> None:
        action = Action(RECV_F, s, mb)
        pending = self.p2p.recv_activation(self.placement[s - 1], s - 1, mb, action)
        self._posted(action, pending.tensor)
        self._recvs[(RECV_F, s, mb)] = pending

    # -- backward ---------------------------------------------------------------------------
    def _output_grad(self, s: int, mb: int) -> torch.Tensor | None:
        if s == self._last[mb]:
            return None
        key = (s, mb)
        if key in self._grads:
            return self._grads.pop(key)
        pending = self._recvs.pop((RECV_B, s, mb), None)
        if pending is None:
            raise RuntimeError(f"stage {s} microbatch {mb}: no output gradient (no RECV_B posted "
                               "and the next stage is not on this rank)")
        return self._wait(pending)

    def _hand_back(self, s: int, mb: int, dx: torch.Tensor | None) -> None:
        if s == self._first[mb]:
            return
        if dx is None:
            raise RuntimeError(f"stage {s} microbatch {mb}: the stage input got no gradient "
                               "(is the stage output independent of its input?)")
        if self._local(s - 1):
            self._grads[(s - 1, mb)] = dx
        else:
            self._dx[(s, mb)] = dx

    def _backward(self, s: int, mb: int) -> None:
        g = self._output_grad(s, mb)
        key = (s, mb)
        self._meta.pop(key, None)
        self._kept.pop(key, None)
        dx, dws = full_backward(self._roots.pop(key), g, self._inputs.pop(key), self.params[s],
                                self.grads_in_place)
        if not self.grads_in_place:
            self.accumulate(s, dws)
        self._hand_back(s, mb, dx)

    def _backward_input(self, s: int, mb: int) -> None:
        g = self._output_grad(s, mb)
        key = (s, mb)
        self._meta.pop(key, None)
        self._kept.pop(key, None)
        dx, now, wgrad = backward_input(self._roots.pop(key), g, self._inputs.pop(key), self.params[s])
        if any(d is not None for d in now):
            self.accumulate(s, now)
        self._wgrad[key] = wgrad
        self._hand_back(s, mb, dx)

    def _backward_weight(self, s: int, mb: int) -> None:
        wgrad = self._wgrad.pop((s, mb))
        dws = wgrad.compute(self.params[s], self.grads_in_place)
        if not self.grads_in_place:
            self.accumulate(s, dws)

    def _send_backward(self, s: int, mb: int) -> None:
        dx = self._dx.pop((s, mb))
        action = Action(SEND_B, s, mb)
        self._posted(action, dx)
        self.p2p.send(dx, self.placement[s - 1], BWD, s - 1, mb, action)

    def _recv_backward(self, s: int, mb: int) -> None:
        shape, dtype = self._meta[(s, mb)]
        action = Action(RECV_B, s, mb)
        pending = self.p2p.recv_gradient(self.placement[s + 1], s, mb, shape, dtype, action)
        self._posted(action, pending.tensor)
        self._recvs[(RECV_B, s, mb)] = pending

    # -- overlapped forward and backward -----------------------------------------------------
    def _overlapped(self, s: int, mb: int) -> None:
        """OVERLAP_F_B (named by its forward part, ``s``, ``mb``): run its parts one after the
        other. Both parts' receives were posted before it and their sends follow it, so on CUDA
        the backward could run on a second stream under the forward (DualPipe hides one part's
        all-to-all under the other's compute); here, as in torch's runtime, they run in turn."""
        table = self.__dict__.get("_overlap_parts")
        if table is None:
            table = self._overlap_parts = {(a.stage, a.microbatch): a.parts
                                           for a in self.actions if a.op == OVERLAP_F_B}
        step = self._step     # the observers saw start(overlap); each part comes inside it
        for part in table[(s, mb)]:
            for hook in self._on_start:
                hook(part, step)
            self._ops[part.op](part.stage, part.microbatch)
            for hook in self._on_end:
                hook(part, step)

    # -- data-parallel sharding (ZeRO) -------------------------------------------------------
    def _unshard(self, s: int, mb: int) -> None:
        self.sharding.unshard(s)

    def _reshard(self, s: int, mb: int) -> None:
        self.sharding.reshard(s)

    def _reduce_grad(self, s: int, mb: int) -> None:
        self.sharding.reduce_grad(s)


def _check_bound_grads(params: dict[int, list[torch.nn.Parameter]], rank: int) -> None:
    """``grads_in_place`` needs every parameter's ``.grad`` to be its gradient buffer already."""
    for s, ps in params.items():
        for k, p in enumerate(ps):
            g = p.grad
            if p.requires_grad and (g is None or g.dtype != p.dtype or g.shape != p.shape):
                raise ValueError(f"rank {rank}: grads_in_place needs each parameter's .grad bound "
                                 f"to its gradient buffer; stage {s} parameter {k} has "
                                 f"{'no .grad' if g is None else f'a {g.dtype} {tuple(g.shape)} .grad'}")


__all__ = ["PipelineRuntime", "PipelineError", "ActionObserver", "StageHooks", "ShardingOps",
           "StepOutput", "InjectedFault", "P2PError"]
