"""The NCCL path's pieces that a CPU can show, with what only CUDA has mocked:
posting order of deferred receives, stream waits with the end-of-step timeout, AdamW's ``step``
placement, device selection and duplicate GPUs, spawn for CUDA, --cpus-per-rank refused with
CUDA, versions in the metrics."""
from __future__ import annotations

import datetime
import re
import sys
import tomllib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pipeexec.launching import devices
from pipeexec.launching.devices import DeviceError, check_unique_gpus, pick_device, start_method_for
from pipeexec.training.optim import adamw_state_for, build_adamw
from pipeexec.pipeline.p2p import BWD, FWD, P2P, P2PError
from pipeexec.versions import SUPPORTED_TORCH, run_versions, torch_supported

ROOT = Path(__file__).resolve().parents[2]


class FakeWork:
    def __init__(self, log, op, tensor, peer, tag, done=True):
        self.log, self.op, self.tensor, self.peer, self.tag = log, op, tensor, peer, tag
        self.done = done
        self.waits: list[tuple] = []

    def wait(self, *args):
        self.waits.append(args)
        return True

    def is_completed(self):
        return self.done


@pytest.fixture
def fake_dist(monkeypatch):
    """dist.isend / irecv that record their calls; a receive of a header gets a (4, 8) fp32
    header, as the real sender would send."""
    log: list = []

    def isend(tensor, peer, group=None, tag=0):
        w = FakeWork(log, "send", tensor, peer, tag)
        log.append(w)
        return w

    def irecv(tensor, peer, group=None, tag=0):
        if tensor.dtype == torch.int64 and tensor.numel() == 10:     # a header
            tensor.copy_(torch.tensor([0, 2, 4, 8, 0, 0, 0, 0, 0, 0]))
        w = FakeWork(log, "recv", tensor, peer, tag)
        log.append(w)
        return w

    monkeypatch.setattr(dist, "isend", isend)
    monkeypatch.setattr(dist, "irecv", irecv)
    return log


def _p2p(pp_rank=1, timeout=5.0, **kw):
    groups = {(k, a, b): f"g{k}{a}{b}" for k in (FWD, BWD) for a, b in ((0, 1), (1, 0))}
    return P2P(rank=pp_rank, pp_rank=pp_rank, groups=groups, peers=(0, 1), num_stages=2,
               num_microbatches=4, device=torch.device("cpu"), timeout=timeout, **kw)


def test_deferred_receives_are_posted_in_channel_order(fake_dist):
    """The bug this fixed: mb 1's receive deferred (shape unknown), mb 2's posted at once after
    F(mb 0) had read the header. Now every receive waits behind the deferred ones."""
    p2p = _p2p(nccl_matching=True)
    log = p2p.record_posting()
    r0 = p2p.recv_activation(0, 0, 0, "1RECV_F0")
    r1 = p2p.recv_activation(0, 0, 1, "1RECV_F1")
    assert fake_dist == []                           # nothing posted: the shape is unknown
    p2p.wait(r0)                                     # F(mb 0): header, mb 0, and mb 1 behind it
    r2 = p2p.recv_activation(0, 0, 2, "1RECV_F2")    # shape known, but queued behind mb 1
    assert [w.tensor.shape for w in fake_dist] == [torch.Size([10]), torch.Size([4, 8])]
    p2p.wait(r1)
    p2p.wait(r2)
    assert log[(FWD, 0, 1)] == [("header", FWD, 0, 0), ("data", FWD, 0, 0), ("data", FWD, 0, 1),
                                ("data", FWD, 0, 2)]
    assert all(w.tag == 0 for w in fake_dist)        # nccl_matching: tags ignored
    # once nothing is deferred, a receive is posted at once
    r3 = p2p.recv_activation(0, 0, 3, "1RECV_F3")
    assert len(fake_dist) == 5 and r3.work is fake_dist[-1]
    # a gradient is never deferred (its shape is known) unless its channel has a deferred one
    p2p.recv_gradient(0, 0, 0, torch.Size([4, 8]), torch.float32, "0RECV_B0")
    assert log[(BWD, 0, 1)] == [("data", BWD, 0, 0)]


def test_tags_kept_without_nccl_matching(fake_dist):
    p2p = _p2p()
    p2p.wait(p2p.recv_activation(0, 0, 3, "1RECV_F3"))
    assert len({w.tag for w in fake_dist}) == 2 and 0 not in {w.tag for w in fake_dist}


def test_stream_waits_do_not_block_and_the_step_end_names_the_stuck_action(fake_dist):
    p2p = _p2p(pp_rank=0, timeout=0.05)
    p2p.stream_waits = True                          # what a CUDA device selects
    r = p2p.recv_gradient(1, 0, 2, torch.Size([4, 8]), torch.float32, "0RECV_B2")
    r.work.done = False                              # the peer never sends
    p2p.wait(r)
    assert r.work.waits == [()]                      # work.wait(): a stream wait, no timeout
    p2p.send(torch.ones(4, 8), 1, FWD, 0, 3, "0SEND_F3")
    with pytest.raises(P2PError, match=r"rank 0: action 0RECV_B2: receive from rank 1 still "
                                       r"incomplete after 0.05 s"):
        p2p.wait_sends()
    r.work.done = True
    p2p.wait_sends()                                 # everything done: returns


def test_host_waits_keep_the_timeout_on_gloo(fake_dist):
    p2p = _p2p(pp_rank=0, timeout=7.0)
    r = p2p.recv_gradient(1, 0, 2, torch.Size([4, 8]), torch.float32, "0RECV_B2")
    p2p.wait(r)
    assert r.work.waits == [(datetime.timedelta(seconds=7.0),)]


# -- AdamW ------------------------------------------------------------------------------------
def test_adamw_step_stays_on_cpu_after_load():
    # A parameter on another device than the CPU ("meta" stands in for "cuda"): the moments
    # follow it, step stays on the CPU, as torch's per-parameter AdamW creates it.
    dev_p = torch.nn.Parameter(torch.empty(3, 2, device="meta"))
    saved = {"step": torch.tensor(5.0), "exp_avg": torch.ones(3, 2), "exp_avg_sq": torch.ones(3, 2)}
    loop = torch.optim.AdamW([dev_p], foreach=False)
    st = adamw_state_for(loop, dev_p, saved)
    assert st["step"].device.type == "cpu" and st["step"].item() == 5.0
    assert st["exp_avg"].device.type == "meta" and st["exp_avg_sq"].device.type == "meta"
    # a capturable (or fused) group keeps step on the parameter's device, as torch creates it
    st = adamw_state_for(torch.optim.AdamW([dev_p], capturable=True), dev_p, saved)
    assert st["step"].device.type == "meta"
    # CPU training: the per-parameter loop, and a loaded state steps on as torch's would
    p = torch.nn.Parameter(torch.randn(3, 2))
    opt = build_adamw([("w", p)], lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    assert opt.param_groups[0]["foreach"] is False and not opt.param_groups[0].get("fused")
    p.grad = torch.ones_like(p)
    opt.state[p] = adamw_state_for(opt, p, saved)
    opt.step()
    assert opt.state[p]["step"].item() == 6.0 and opt.state[p]["step"].device.type == "cpu"


# -- devices ----------------------------------------------------------------------------------
def test_cuda_means_local_rank_modulo_visible_count():
    assert pick_device(5, "cuda", count=1) == torch.device("cuda", 0)    # one GPU per process
    assert pick_device(5, "cuda", count=4) == torch.device("cuda", 1)
    assert pick_device(5, None, count=8) == torch.device("cuda", 5)
    assert pick_device(5, None, count=0) == torch.device("cpu")
    assert pick_device(5, "cuda:3", count=8) == torch.device("cuda", 3)
    assert pick_device(5, "cpu", count=8) == torch.device("cpu")
    with pytest.raises(DeviceError, match="no CUDA device is visible to local rank 5"):
        pick_device(5, "cuda", count=0)


def test_device_count_via_nvml_and_spawn_when_cuda_may_be_used(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 2)

    def poisoned(*a, **k):
        raise AssertionError("initialised CUDA in the launcher")

    monkeypatch.setattr(torch.cuda, "is_available", poisoned)
    monkeypatch.setattr(torch.cuda, "device_count", poisoned)
    assert devices.cuda_device_count() == 2
    assert start_method_for(None, None) == "spawn"
    assert start_method_for("cuda", None) == "spawn"
    assert start_method_for("cpu", None) == "fork"
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: -1)   # NVML failed
    assert devices.cuda_device_count() == 0 and start_method_for(None, None) == "fork"
    assert start_method_for(None, "nccl") == "spawn"


def test_duplicate_gpus_are_found_by_uuid(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    store = dist.HashStore()
    store.set("gpu-uuid/0/0", "GPU-aaaa")          # rank 0 has published its GPU
    with pytest.raises(DeviceError, match=r"ranks 0 and 1 are on the same GPU \(GPU-aaaa\)"):
        check_unique_gpus(store, 1, 2, "GPU-aaaa", timeout=5)
    store = dist.HashStore()
    store.set("gpu-uuid/0/0", "GPU-aaaa")
    check_unique_gpus(store, 1, 2, "GPU-bbbb", timeout=5)     # distinct GPUs: fine
    # a torchrun restart does not read the previous round's keys
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    store.set("gpu-uuid/1/0", "GPU-bbbb")          # ranks swapped GPUs in the new round
    check_unique_gpus(store, 1, 2, "GPU-aaaa", timeout=5)


def test_nccl_matching_flag_reaches_the_config():
    from pipeexec.cli.train import config_from_args
    from pipeexec.cli.main import _parser
    given = config_from_args(_parser().parse_args(["train", "--nccl-matching"]))
    assert given.runtime.nccl_matching
    assert not config_from_args(_parser().parse_args(["train"])).runtime.nccl_matching


def test_channel_keys_are_the_ring_neighbours_both_ways():
    from pipeexec.topology import channel_keys
    assert channel_keys(1) == []
    assert channel_keys(2) == [(0, 0, 1), (1, 0, 1), (0, 1, 0), (1, 1, 0)]
    keys = channel_keys(4)
    assert len(keys) == 16 and len(set(keys)) == 16
    pairs = {(a, b) for _, a, b in keys}
    assert pairs == {(r, (r + 1) % 4) for r in range(4)} | {((r + 1) % 4, r) for r in range(4)}
    # every transfer of every builder's placement runs on one of them
    import pipesim
    from pipesim.schedule.channels import transfer_of
    for name in pipesim.schedule_names():
        for vpp in (1, 2):
            try:
                s = pipesim.build_schedule(name, pp=4, vpp=vpp, microbatches=8)
            except pipesim.ScheduleError:
                continue
            for r in range(4):
                for a in s.actions(r):
                    if a.op.startswith(("SEND", "RECV")):
                        t = transfer_of(s, r, a)
                        assert (0 if t.kind == "F" else 1, t.src, t.dst) in keys, (name, a)


def test_a_placement_beyond_ring_neighbours_is_refused_before_start():
    import pipesim
    from pipesim.schedule.action import Action as A
    from pipeexec.pipeline.p2p import check_channels_exist
    from pipeexec.topology import channel_keys
    # pp 4, stage 0 on rank 0 and stage 1 on rank 2: not neighbours
    compute = [[A("F", 0, 0), A("B", 0, 0)], [A("F", 2, 0), A("B", 2, 0)],
               [A("F", 1, 0), A("B", 1, 0)], [A("F", 3, 0), A("B", 3, 0)]]
    s = pipesim.Schedule(4, 1, 1, (0, 2, 1, 3), compute, name="skip").validate()
    with pytest.raises(P2PError, match=r"pipeline rank 0: 0SEND_F0 needs a channel from rank 0 "
                                       r"to 2"):
        check_channels_exist(s, 0, channel_keys(4))
    check_channels_exist(pipesim.build_schedule("zbv", pp=4, vpp=2, microbatches=8), 0,
                         channel_keys(4))


def test_cpus_per_rank_refused_with_cuda(capsys):
    from pipeexec.cli.main import main
    with pytest.raises(SystemExit) as info:
        main(["train", "--device", "cuda", "--cpus-per-rank", "1", "--no-progress"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--cpus-per-rank is for CPU runs" in err or "no CUDA device is visible" in err


def test_cpus_per_rank_refused_when_a_gpu_is_visible(capsys, monkeypatch):
    from pipeexec.cli.main import main
    monkeypatch.setattr(devices, "cuda_device_count", lambda: 2)     # as NVML would count
    with pytest.raises(SystemExit) as info:
        main(["train", "--cpus-per-rank", "1", "--no-progress"])     # device None -> cuda
    assert info.value.code == 2
    assert "--cpus-per-rank is for CPU runs" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["train", "--device", "cuda", "--cpus-per-rank", "1", "--no-progress"])
    assert "--cpus-per-rank is for CPU runs" in capsys.readouterr().err


def test_cuda_without_a_visible_gpu_is_refused_before_start(capsys, monkeypatch):
    from pipeexec.cli.main import main
    monkeypatch.setattr(devices, "cuda_device_count", lambda: 0)
    with pytest.raises(SystemExit) as info:
        main(["train", "--device", "cuda", "--no-progress"])
    assert info.value.code == 2
    assert "--device cuda: no CUDA device is visible here" in capsys.readouterr().err


# -- versions ---------------------------------------------------------------------------------
def test_versions_and_the_supported_range_agree_with_pyproject():
    v = run_versions("gloo")
    assert v["torch"] == torch.__version__ and v["nccl"] is None
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["exec"]
    spec = next(s for s in extra if s.startswith("torch"))
    lo, hi = re.fullmatch(r"torch>=(\d+\.\d+),<(\d+\.\d+)", spec).groups()
    assert (tuple(map(int, lo.split("."))), tuple(map(int, hi.split(".")))) == SUPPORTED_TORCH
    assert torch_supported("2.6.0") and torch_supported("2.13.0+cpu")
    assert not torch_supported("2.5.1") and not torch_supported(f"{SUPPORTED_TORCH[1][0]}."
                                                               f"{SUPPORTED_TORCH[1][1]}.0")
    assert torch_supported()          # the torch this suite runs on is in the range


if sys.version_info < (3, 11):        # tomllib
    pytestmark = pytest.mark.skip("needs Python 3.11")


# -- measuring on a GPU (CUDA mocked) ---------------------------------------------------------
def test_probe_times_with_cuda_events(monkeypatch):
    from pipeexec.measuring import probe
    calls = []

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            calls.append("new")

        def record(self):
            calls.append("record")

        def synchronize(self):
            calls.append("sync")

        def elapsed_time(self, other):
            return 12.5                        # milliseconds, as torch's

    def no_sync(*a):
        raise AssertionError("host synchronize: times the launch overhead, not the kernels")

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", no_sync)
    value, (wall, cpu) = probe._timed(torch.device("cuda", 0), lambda: (calls.append("fn"), 7)[1])
    assert value == 7 and wall == pytest.approx(0.0125) and cpu != cpu
    assert calls == ["new", "new", "record", "fn", "record", "sync"]


def test_step_peaks_on_cuda_and_nan_on_cpu(monkeypatch):
    import math

    from pipeexec.training.train import StepStats, with_peaks
    s = StepStats(0, 1.0, 0.1, 1.0, 1e-3, 1.0, False, 10.0)
    assert math.isnan(with_peaks(s, torch.device("cpu")).max_memory_allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: 1000)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: 2048)
    got = with_peaks(s, torch.device("cuda", 0))
    assert (got.max_memory_allocated, got.max_memory_reserved) == (1000.0, 2048.0)
