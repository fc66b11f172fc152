"""Single-process checks of the executor's pieces (no process group): split backward, the
action interpreter on one rank (local hand-offs between chunks), partitioning, data, init,
learning rate and loss scaling."""
from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch.autograd.graph import get_gradient_edge

import pipesim
from pipesim.schedule.action import I, W, Action
from pipeexec.pipeline.backward import backward_input, full_backward
from pipeexec.data import BatchSource
from pipeexec.training.ddp import GradBuffer
from pipeexec.config import GPT_MODEL
from pipeexec.model import gpt_stack, lm_loss
from pipeexec.training.optim import clip_coefficient, lr_at
from pipeexec.partition import PartitionError, by_layers, by_params, explicit
from pipeexec.training.precision import LossScaler
from pipeexec.pipeline.runtime import PipelineError, PipelineRuntime
from pipeexec.pipeline.stage import build_stage

SPEC = gpt_stack(GPT_MODEL.with_(layers=4, hidden=16, heads=2, seq_length=8, vocab=32))


def _layers(idxs, seed=0):
    return [SPEC.build_layer(i, seed) for i in idxs]


# -- split backward ------------------------------------------------------------------------------
@pytest.mark.parametrize("idxs,first", [([0, 1], True), ([2, 3], False), ([4, 5], False)])
def test_split_backward_equals_full_backward(idxs, first):
    layers = _layers(idxs)
    params = [p for layer in layers for p in layer.parameters()]
    gen = torch.Generator().manual_seed(0)
    inp = torch.randint(0, 32, (2, 8), generator=gen) if first else torch.randn(2, 8, 16, generator=gen)

    def run(split):
        x = inp if first else inp.clone().requires_grad_(True)
        y = x
        for layer in layers:
            y = layer(y)
        g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
        root = get_gradient_edge(y)
        y.data = torch.empty(1)          # the output's storage is gone, as after a send
        if not split:
            return full_backward(root, g, x, params)
        dx, now, wgrad = backward_input(root, g, x, params)
        later = wgrad.compute(params)
        assert all(a is None or b is None for a, b in zip(now, later))
        return dx, [a if a is not None else b for a, b in zip(now, later)]

    (dx_full, dw_full), (dx_split, dw_split) = run(False), run(True)
    if first:
        assert dx_full is None and dx_split is None
    else:
        torch.testing.assert_close(dx_split, dx_full, rtol=0, atol=0)
    assert all(g is not None for g in dw_split)
    for a, b in zip(dw_split, dw_full):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class _Count(torch.autograd.Function):
    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _Count.calls += 1
        return g


def test_weight_pass_does_not_redo_the_input_pass():
    """W must evaluate only the weight branches: the input path's nodes run once, in I."""
    l1, l2 = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    y = l2(_Count.apply(torch.tanh(l1(x))))
    _Count.calls = 0
    params = list(l1.parameters()) + list(l2.parameters())
    dx, now, wgrad = backward_input(get_gradient_edge(y), torch.ones(3, 4), x, params)
    assert _Count.calls == 1 and dx is not None and all(g is None for g in now)
    dws = wgrad.compute(params)
    assert _Count.calls == 1, "W re-ran part of the input-gradient pass"
    ref = torch.autograd.grad(l2(_Count.apply(torch.tanh(l1(x)))), params, torch.ones(3, 4))
    for a, b in zip(dws, ref):
        torch.testing.assert_close(a, b)


def test_shared_parameter_is_not_counted_twice():
    """One weight used by two layers in sequence: both join nodes in one group, no double count."""
    lin = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    y = lin(torch.relu(lin(x)))
    params = list(lin.parameters())
    dx, now, wgrad = backward_input(get_gradient_edge(y), torch.ones(3, 4), x, params)
    dws = wgrad.compute(params)
    ref = torch.autograd.grad(lin(torch.relu(lin(x))), [x] + params, torch.ones(3, 4))
    torch.testing.assert_close(dx, ref[0])
    for a, b in zip(dws, ref[1:]):
        torch.testing.assert_close(a, b)


# -- the interpreter on one rank -----------------------------------------------------------------
def _reference_grads(spec, seed, batches, m):
    layers = [spec.build_layer(i, seed) for i in range(spec.num_layers)]
    params = [p for layer in layers for p in layer.parameters()]
    total = [torch.zeros_like(p) for p in params]
    for x, y in batches:
        h = x
        for layer in layers:
            h = layer(h)
        for t, g in zip(total, torch.autograd.grad(lm_loss(h, y) / m, params)):
            t += g
    return total


def _one_rank_grads(schedule, spec, seed, batches, in_place=False, steps=1):
    bounds = by_layers(spec.num_layers, schedule.num_stages)
    stages = {s: build_stage(spec, s, bounds, seed=seed, device=torch.device("cpu"),
                             dtype=torch.float32) for s in schedule.rank_stages(0)}
    buf = GradBuffer({s: list(st.parameters()) for s, st in stages.items()}, torch.device("cpu"))
    assert buf.bind() if in_place else True
    rt = PipelineRuntime(schedule, 0, stages, spec.loss_fn, buf.accumulate, None, global_rank=0,
                         device=torch.device("cpu"), grads_in_place=in_place)
    for step in range(steps):          # the buffer is zeroed between steps, as in training
        buf.zero()
        out = rt.run(batches, step=step)
    return [v for s in sorted(stages) for v in buf.views[s]], out


def _single_rank_schedules():
    for name in pipesim.schedule_names():
        for vpp in (3, 2, 1):
            try:
                yield name, pipesim.build_schedule(name, pp=1, vpp=vpp, microbatches=3).validate()
                break
            except pipesim.ScheduleError:
                continue


def _custom_split_schedule():
    """Hand-made: three chunks on one rank, every F, then I in reverse, then W in another order."""
    order = [Action("F", s, mb) for mb in range(3) for s in range(3)]
    order += [Action(I, s, mb) for s in (2, 1, 0) for mb in range(3)]
    order += [Action(W, s, mb) for mb in (1, 0, 2) for s in (0, 2, 1)]
    return pipesim.Schedule(1, 3, 3, "looped", [order], name="custom").validate()


@pytest.mark.parametrize("name,schedule", [*_single_rank_schedules(), ("custom", _custom_split_schedule())],
                         ids=lambda v: v if isinstance(v, str) else "")
def test_interpreter_gradients_match_plain_backward(name, schedule):
    src = BatchSource(seed=1, seq_len=8, vocab=32, global_batch=6)
    batches = src.microbatches(0, 0, 1, 3)
    grads, out = _one_rank_grads(schedule, SPEC, 5, batches)
    ref = _reference_grads(SPEC, 5, batches, 3)
    assert sorted(out.losses) == [0, 1, 2]
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # autograd adding into the bound buffer gives the same sums as adding returned gradients,
    # and still after the buffer was zeroed for a second step
    in_place, _ = _one_rank_grads(schedule, SPEC, 5, batches, in_place=True, steps=2)
    for a, b in zip(in_place, grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


def test_grads_in_place_needs_bound_grads():
    sched = pipesim.build_schedule("1f1b", pp=1, microbatches=2)
    stage = build_stage(SPEC, 0, by_layers(SPEC.num_layers, 1), seed=0,
                        device=torch.device("cpu"), dtype=torch.float32)
    with pytest.raises(ValueError, match="rank 3: grads_in_place .* stage 0 parameter 0 has no .grad"):
        PipelineRuntime(sched, 0, {0: stage}, SPEC.loss_fn, lambda s, g: None, None,
                        global_rank=3, device=torch.device("cpu"), grads_in_place=True)
    assert not GradBuffer({0: [p.to(torch.bfloat16) for p in stage.parameters()]},
                          torch.device("cpu")).bind()      # 16-bit parameters: not bound
    buf = GradBuffer({0: list(stage.parameters())}, torch.device("cpu"))
    assert buf.bind()
    rt = PipelineRuntime(sched, 0, {0: stage}, SPEC.loss_fn, lambda s, g: None, None,
                         global_rank=3, device=torch.device("cpu"), grads_in_place=True)
    next(stage.parameters()).grad = None       # e.g. an optimizer's zero_grad(set_to_none=True)
    src = BatchSource(seed=1, seq_len=8, vocab=32, global_batch=2)
    with pytest.raises(PipelineError, match="stage 0 parameter 0: its .grad was replaced"):
        rt.run(src.microbatches(0, 0, 1, 2), step=0)


def test_interpreter_names_rank_and_action_on_error():
    sched = pipesim.build_schedule("1f1b", pp=1, microbatches=2)
    bounds = by_layers(SPEC.num_layers, 1)
    stage = build_stage(SPEC, 0, bounds, seed=0, device=torch.device("cpu"), dtype=torch.float32)

    def bad_loss(out, target):
        raise ValueError("boom")
    rt = PipelineRuntime(sched, 0, {0: stage}, bad_loss, lambda s, g: None, None, global_rank=5,
                         device=torch.device("cpu"))
    src = BatchSource(seed=1, seq_len=8, vocab=32, global_batch=2)
    with pytest.raises(PipelineError, match=r"rank 5 \(pp rank 0\) failed in action 0F0 of step 3: ValueError: boom"):
        rt.run(src.microbatches(3, 0, 1, 2), step=3)


# -- partitioning --------------------------------------------------------------------------------
def test_partition_by_layers():
    assert by_layers(8, 4) == (0, 2, 4, 6, 8)
    assert by_layers(10, 4) == (0, 3, 6, 8, 10)      # pipesim's even split: the first stages more
    with pytest.raises(PartitionError, match="3 layers cannot fill 4 stages"):
        by_layers(3, 4)


def test_partition_by_params_is_optimal():
    counts = [50, 10, 10, 10, 10, 10, 10, 60]
    for k in (2, 3, 4):
        bounds = by_params(counts, k)
        got = max(sum(counts[bounds[s]: bounds[s + 1]]) for s in range(k))
        best = min(max(sum(counts[a:b]) for a, b in zip((0, *cuts), (*cuts, len(counts))))
                   for cuts in itertools.combinations(range(1, len(counts)), k - 1))
        assert got == best
        assert all(bounds[s] < bounds[s + 1] for s in range(k))


def test_partition_explicit():
    assert explicit([1, 5], 8, 3) == (0, 1, 5, 8)
    with pytest.raises(PartitionError, match="leave stage 1 empty"):
        explicit([3, 3], 8, 3)
    with pytest.raises(PartitionError, match="need 2 values"):
        explicit([3], 8, 3)


# -- model, data ---------------------------------------------------------------------------------
def test_layer_init_depends_only_on_seed_and_index():
    a, b = SPEC.build_layer(2, 11), SPEC.build_layer(2, 11)
    c = SPEC.build_layer(3, 11)
    for p, q, r in zip(a.parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q)
    assert not all(torch.equal(p, r) for p, r in zip(a.parameters(), c.parameters()) if p.dim() > 1)
    counts = SPEC.layer_param_counts()
    assert counts == tuple(sum(p.numel() for p in SPEC.build_layer(i, 0).parameters())
                           for i in range(SPEC.num_layers))


def test_microbatches_partition_the_global_batch():
    src = BatchSource(seed=4, seq_len=8, vocab=32, global_batch=8)
    x, y = src.global_batch_at(2)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(src.global_batch_at(2)[0], x)            # deterministic
    assert not torch.equal(src.global_batch_at(3)[0], x)
    for dp, m in ((1, 4), (2, 2), (2, 4), (4, 2)):
        rows = torch.cat([mb[0] for d in range(dp) for mb in src.microbatches(2, d, dp, m)])
        assert torch.equal(rows, x)


def test_text_file_data(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(bytes(range(256)) * 4)
    src = BatchSource(seed=0, seq_len=16, vocab=256, global_batch=4, data=str(path))
    x, y = src.global_batch_at(0)
    assert x.shape == (4, 16)
    assert torch.equal((x + 1) % 256, y)   # consecutive bytes


# -- optimiser pieces ----------------------------------------------------------------------------
def test_lr_warmup_then_cosine():
    kw = dict(lr=1.0, min_lr=0.1, warmup=2, decay_steps=6)
    assert lr_at(0, **kw) == 0.5 and lr_at(1, **kw) == 1.0
    assert lr_at(4, **kw) == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi / 2)) / 2)
    assert lr_at(6, **kw) == pytest.approx(0.1) and lr_at(9, **kw) == pytest.approx(0.1)


def test_clip_coefficient_matches_torch():
    g = [torch.randn(5) * 3, torch.randn(3)]
    norm = math.sqrt(sum((t ** 2).sum().item() for t in g))
    mine = [t * clip_coefficient(norm, 1.0) for t in g]
    theirs = [t.clone() for t in g]
    torch.nn.utils.clip_grad_norm_([torch.nn.Parameter(t) for t in theirs], 1.0)
    ps = [torch.nn.Parameter(t.clone()) for t in g]
    for p, t in zip(ps, g):
        p.grad = t.clone()
    torch.nn.utils.clip_grad_norm_(ps, 1.0)
    for a, p in zip(mine, ps):
        torch.testing.assert_close(a, p.grad)


def test_loss_scaler_backs_off_and_grows():
    s = LossScaler(dynamic=True, initial=8.0, growth_interval=2)
    s.update(True)
    assert s.scale == 4.0
    s.update(False)
    assert s.scale == 4.0
    s.update(False)
    assert s.scale == 8.0
    static = LossScaler(dynamic=False, initial=8.0)
    static.update(True)
    assert static.scale == 1.0


# -- p2p channel order (what NCCL needs) ---------------------------------------------------------
def test_registered_schedules_keep_channel_order():
    from pipeexec.pipeline.p2p import check_p2p_order
    for name in pipesim.schedule_names():
        for pp, m in ((2, 4), (4, 8)):
            for vpp in (2, 1):
                try:
                    sched = pipesim.build_schedule(name, pp=pp, vpp=vpp, microbatches=m).validate()
                except pipesim.ScheduleError:
                    continue
                for lookahead in (0, 1, 2, 5):   # posting receives early keeps channel order
                    check_p2p_order(sched.with_recv_lookahead(lookahead))
                break


def test_channel_order_violation_is_reported():
    from pipeexec.pipeline.p2p import P2PError, check_p2p_order
    A = Action
    rank0 = [A("F", 0, 0), A("SEND_F", 0, 0), A("F", 0, 1), A("SEND_F", 0, 1)]
    rank1 = [A("RECV_F", 1, 1), A("F", 1, 1), A("RECV_F", 1, 0), A("F", 1, 0)]
    sched = pipesim.Schedule(2, 1, 2, "looped", [rank0, rank1], name="swapped",
                             forward_only=True).validate()
    with pytest.raises(P2PError, match=r"rank 1's 1RECV_F1 .* would match rank 0's 0SEND_F0"):
        check_p2p_order(sched)


def test_recorder_sees_every_action_once_in_order():
    class Recorder:
        def __init__(self):
            self.events = []

        def start(self, action, step):
            self.events.append(("start", action, step))

        def end(self, action, step):
            self.events.append(("end", action, step))

    sched = pipesim.build_schedule("zbv", pp=1, vpp=2, microbatches=3).validate()
    bounds = by_layers(SPEC.num_layers, 2)
    stages = {s: build_stage(SPEC, s, bounds, seed=0, device=torch.device("cpu"), dtype=torch.float32)
              for s in (0, 1)}
    rec = Recorder()
    rt = PipelineRuntime(sched, 0, stages, SPEC.loss_fn, lambda s, g: None, None, global_rank=0,
                         device=torch.device("cpu"), observers=[rec])
    rt.run(BatchSource(seed=1, seq_len=8, vocab=32, global_batch=3).microbatches(4, 0, 1, 3), step=4)
    expected = [(kind, a, 4) for a in sched.actions(0) for kind in ("start", "end")]
    assert rec.events == expected


def test_user_layer_list_and_loss():
    """A model brought as a layer list + loss (float inputs, MSE) runs through the same path."""
    from pipeexec.model import model_from_layers
    gen = torch.Generator().manual_seed(3)
    layers = [torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh()),
              torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()), torch.nn.Linear(8, 1)]
    spec = model_from_layers(layers, F.mse_loss)
    batches = [(torch.randn(5, 4, generator=gen), torch.randn(5, 1, generator=gen)) for _ in range(3)]
    sched = pipesim.build_schedule("zbv", pp=1, vpp=2, microbatches=3).validate()
    bounds = by_layers(3, 2)
    stages = {s: build_stage(spec, s, bounds, seed=0, device=torch.device("cpu"), dtype=torch.float32)
              for s in (0, 1)}
    buf = GradBuffer({s: list(st.parameters()) for s, st in stages.items()}, torch.device("cpu"))
    rt = PipelineRuntime(sched, 0, stages, spec.loss_fn, buf.accumulate, None, global_rank=0,
                         device=torch.device("cpu"))
    rt.run(batches)
    params = [p for layer in layers for p in layer.parameters()]
    ref = [torch.zeros_like(p) for p in params]
    for x, y in batches:
        h = x
        for layer in layers:
            h = layer(h)
        for r, g in zip(ref, torch.autograd.grad(F.mse_loss(h, y) / 3, params)):
            r += g
    got = [v for s in (0, 1) for v in buf.views[s]]
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)


def test_observers_are_called_in_order_and_can_be_added_and_removed():
    """The per-action seams are observers: starts in order, ends in reverse (nesting), and a
    fault injector is one of them (it fails the action it names, before the action runs)."""
    from pipeexec.pipeline.faults import FaultInjector
    from pipeexec.pipeline.runtime import InjectedFault, PipelineError

    log = []

    class Obs:
        def __init__(self, name):
            self.name = name

        def start(self, action, step):
            log.append((self.name, "start", str(action)))

        def end(self, action, step):
            log.append((self.name, "end", str(action)))

    sched = pipesim.build_schedule("1f1b", pp=1, microbatches=2).validate()
    bounds = by_layers(SPEC.num_layers, 1)
    stages = {0: build_stage(SPEC, 0, bounds, seed=0, device=torch.device("cpu"),
                             dtype=torch.float32)}
    a, b = Obs("a"), Obs("b")
    rt = PipelineRuntime(sched, 0, stages, SPEC.loss_fn, lambda s, g: None, None, global_rank=0,
                         device=torch.device("cpu"), observers=[a, b])
    mbs = BatchSource(seed=1, seq_len=8, vocab=32, global_batch=2).microbatches(0, 0, 1, 2)
    rt.run(mbs, step=0)
    first = str(sched.actions(0)[0])
    assert log[:4] == [("a", "start", first), ("b", "start", first), ("b", "end", first),
                       ("a", "end", first)]
    assert len(log) == 4 * len(sched.actions(0))
    log.clear()
    rt.remove_observer(a)
    rt.add_observer(b)                          # already there: once
    rt.add_observer(FaultInjector({1: {str(sched.actions(0)[1]): "raise"}}))
    rt.run(mbs, step=0)
    assert {name for name, _, _ in log} == {"b"} and len(log) == 2 * len(sched.actions(0))
    log.clear()
    with pytest.raises(PipelineError, match=f"action {sched.actions(0)[1]} of step 1") as info:
        rt.run(mbs, step=1)
    assert isinstance(info.value.__cause__, InjectedFault)
    assert log[-1] == ("b", "start", str(sched.actions(0)[1]))   # failed before running it


def test_no_module_reads_another_objects_private_state():
    """``obj._name`` only on ``self`` / ``cls`` across pipeexec (torch's own privates aside)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "pipeexec"
    pattern = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)\._[a-z][a-z0-9_]*")
    found = [f"{p.relative_to(root)}:{n}: {m.group(0)}"
             for p in root.rglob("*.py")
             for n, line in enumerate(p.read_text().splitlines(), 1)
             for m in pattern.finditer(line)
             if m.group(1) not in ("self", "cls", "torch", "cuda", "dist", "os", "sys")
             # transformers' attention switch on its configs: underscored, yet the one its
             # documentation names for choosing an implementation (AttentionInterface)
             and not m.group(0).endswith("._attn_implementation")]
    assert not found, found
