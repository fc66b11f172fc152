"""CPU limits and per-rank CPU quotas (pipeexec.launching.cpu_quota): the limit read back through a fake
cgroup tree (v1 and v2), and, where this machine lets us write cgroups, real workers confined to
a share of a CPU: their limit reads back, a busy loop gets no more CPU than the quota, and the
cgroups are gone afterwards."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from pipeexec.launching import cpu_quota
from pipeexec.launching.cpu_quota import QuotaUnavailable, RankQuotas, cpu_limit, quotas_available
from pipeexec.launching.launcher import launch


def affinity() -> float:
    return float(len(os.sched_getaffinity(0)))


def fake_tree(monkeypatch, tmp_path, version: str, own: str) -> None:
    kind = "cgroup" if version == "v1" else "cgroup2"
    monkeypatch.setattr(cpu_quota, "_mounts", lambda: [(str(tmp_path), kind, {"rw", "cpu"})])
    monkeypatch.setattr(cpu_quota, "_own_cgroups",
                        lambda: {"cpu" if version == "v1" else "": own})
    (tmp_path / own.strip("/")).mkdir(parents=True)
    if version == "v2":
        (tmp_path / own.strip("/") / "cgroup.controllers").write_text("cpuset cpu io\n")


def test_limit_is_the_smallest_quota_on_the_path_v1(monkeypatch, tmp_path):
    fake_tree(monkeypatch, tmp_path, "v1", "/job/rank1")
    (tmp_path / "job" / "cpu.cfs_quota_us").write_text("75000\n")
    (tmp_path / "job" / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "job" / "rank1" / "cpu.cfs_quota_us").write_text("-1\n")   # no quota of its own
    (tmp_path / "job" / "rank1" / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_limit() == pytest.approx(min(affinity(), 0.75))
    (tmp_path / "job" / "rank1" / "cpu.cfs_quota_us").write_text("20000\n")
    assert cpu_limit() == pytest.approx(min(affinity(), 0.2))


def test_limit_reads_cpu_max_v2(monkeypatch, tmp_path):
    fake_tree(monkeypatch, tmp_path, "v2", "/a")
    (tmp_path / "a" / "cpu.max").write_text("max 100000\n")
    assert cpu_limit() == affinity()
    (tmp_path / "a" / "cpu.max").write_text("50000 100000\n")
    assert cpu_limit() == pytest.approx(min(affinity(), 0.5))
    (tmp_path / "cpu.max").write_text("garbage")                 # unreadable: ignored
    assert cpu_limit() == pytest.approx(min(affinity(), 0.5))


def test_no_cgroup_controller_is_a_clear_error_before_any_worker(monkeypatch):
    monkeypatch.setattr(cpu_quota, "_cpu_dir", lambda: None)
    assert cpu_limit() == affinity()
    with pytest.raises(QuotaUnavailable, match="cpus_per_rank: no cgroup CPU controller"):
        launch(_never_runs, 2, cpus_per_rank=0.5, timeout=30)
    with pytest.raises(ValueError, match="positive number"):
        RankQuotas(2, 0.0)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_quotas_are_written_per_rank_and_removed(monkeypatch, tmp_path, version):
    monkeypatch.setattr(cpu_quota, "_cpu_dir", lambda: (tmp_path, version, tmp_path))
    for cpus, period in ((0.5, 2000), (0.25, 4000), (1.5, 2000)):
        q = RankQuotas(3, cpus)
        assert [d.name for d in q.dirs] == ["rank0", "rank1", "rank2"]
        for d in q.dirs:
            if version == "v1":
                assert int((d / "cpu.cfs_period_us").read_text()) == period
                assert int((d / "cpu.cfs_quota_us").read_text()) == round(cpus * period)
            else:
                assert (d / "cpu.max").read_text() == f"{round(cpus * period)} {period}"
            assert cpu_quota._quota(d, version) == pytest.approx(cpus)
        if version == "v2":
            assert (q.root / "cgroup.subtree_control").read_text() == "+cpu"
        for d in q.dirs:                    # a real cgroup's files vanish with it; these don't
            for f in d.iterdir():
                f.unlink()
        for f in q.root.iterdir():
            if f.is_file():
                f.unlink()
        q.close()
        assert list(tmp_path.iterdir()) == []


def _never_runs(board):
    raise AssertionError("no worker may start without its quota")


def _spin(board, seconds: float) -> tuple[float, float, str, int]:
    start_wall, start_cpu = time.perf_counter(), time.thread_time()
    while time.perf_counter() - start_wall < seconds:
        sum(range(1000))
    share = (time.thread_time() - start_cpu) / (time.perf_counter() - start_wall)
    found = cpu_quota._cpu_dir()
    throttled = -1
    if found is not None:
        stat = dict(line.split() for line in (found[0] / "cpu.stat").read_text().splitlines())
        throttled = int(stat.get("nr_throttled", -1))
    return cpu_limit(), share, Path("/proc/self/cgroup").read_text(), throttled


@pytest.mark.skipif(not quotas_available(), reason="no writable cgroup CPU controller here")
def test_confined_workers_get_their_share_and_the_cgroups_are_removed():
    results = launch(_spin, 2, (0.4,), cpus_per_rank=0.25, timeout=60)
    for limit, share, cgroups, throttled in results:
        assert limit == pytest.approx(0.25)
        # one spinning thread on a quarter of a CPU gets at most a quarter of the wall time
        # (slack for the quota period, 2 ms, at both ends of the window; a loaded machine only
        # lowers the share), and the kernel throttled it to get there
        assert share < 0.45
        assert throttled > 0
        assert "pipeexec-" in cgroups
    found = cpu_quota._cpu_dir()
    assert found is not None
    assert not [p for p in found[0].iterdir() if p.name.startswith(f"pipeexec-{os.getpid()}-")]
    # without a quota the same loop runs on a whole CPU (this process's own limit)
    (limit, _, cgroups, _), = launch(_spin, 1, (0.2,), timeout=60)
    assert limit == pytest.approx(cpu_limit()) and "pipeexec-" not in cgroups


def test_cpus_per_rank_is_refused_under_torchrun(monkeypatch, capsys):
    from pipeexec.cli.main import main

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as info:
        main(["train", "--pp", "2", "--cpus-per-rank", "0.5", "--no-progress"])
    assert info.value.code == 2
    assert "--cpus-per-rank confines the workers of a local run" in capsys.readouterr().err
