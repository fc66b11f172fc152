"""Metrics on measured-style traces, the summary, the Chrome trace and the Gantt chart."""
import json
import subprocess
import sys
from collections import Counter, defaultdict

import pytest

import pipesim
from pipesim import CostModel, SimResult, simulate
from pipesim.sim.metrics import union_length


def latency_run():
    s = pipesim.build_schedule("gpipe", pp=2, microbatches=3)
    return simulate(s, CostModel(forward=1.0, backward=1.0, p2p_latency=3.0))


def test_comm_wait_and_summary_by_hand():
    r = latency_run()
    # Worked by hand (see the docstring of pipesim.sim.metrics for the definition): rank 0 computes
    # 0-3, 15-16, 18-19, 21-22 and has comm in flight over [1, 15] U [16, 18] U [19, 21].
    assert r.makespan == 22.0
    assert r.busy == [6.0, 6.0]
    assert r.comm_wait == [16.0, 15.0]
    table = r.summary()
    assert list(table.index) == ["0", "1", "all"]
    assert table.loc["0", "idle"] == 16.0 and table.loc["1", "bubble"] == 10.0 - 6.0
    assert table.attrs["bubble_fraction"] == pytest.approx((22 - 6) / 6)
    text = r.summary_text()
    assert "bubble_fraction (Megatron" in text and "bubble_rate (ZB" in text


def test_union_length():
    assert union_length([0, 1, 5], [2, 3, 6]) == 4.0
    assert union_length([0, 1], [10, 2]) == 10.0
    assert union_length([], []) == 0.0


def test_metrics_from_a_measured_style_trace():
    """Shifted clock, no bytes/peer columns, plain string ops: metrics are unchanged."""
    base = simulate(pipesim.build_schedule("zb-h1", pp=4, microbatches=8),
                    CostModel.uniform(1.0, backward_input=1.0, backward_weight=0.5))
    tr = base.trace.drop(columns=["bytes", "peer"]).copy()
    tr["op"] = tr["op"].astype(str)
    tr["kind"] = tr["kind"].astype(str)
    tr["start"] += 1000.0
    tr["end"] += 1000.0
    m = SimResult.from_trace(tr)
    assert m.source == "measured" and m.num_ranks == 4
    for name in ("makespan", "bubble_fraction", "bubble_rate", "bubble_time"):
        assert getattr(m, name) == pytest.approx(getattr(base, name), abs=1e-9)
    assert m.peak_inflight == base.peak_inflight
    assert m.busy == pytest.approx(base.busy)
    data = m.to_chrome_trace()
    assert any(e["ph"] == "s" for e in data["traceEvents"])
    m.gantt(comm=True)


def test_trace_checks():
    tr = latency_run().trace
    with pytest.raises(ValueError, match="missing column"):
        SimResult.from_trace(tr.drop(columns=["kind"]))
    bad = tr.copy()
    bad.loc[bad.index[0], "end"] = -1.0
    with pytest.raises(ValueError, match="ends .* before it starts"):
        SimResult.from_trace(bad)


@pytest.mark.parametrize("name,vpp", [("1f1b", 1), ("interleaved", 2), ("zbv", 2)])
def test_chrome_trace_is_valid(tmp_path, name, vpp):
    s = pipesim.build_schedule(name, pp=4, vpp=vpp, microbatches=8)
    r = simulate(s, CostModel.uniform(p2p_latency=0.3))
    path = tmp_path / "t.json"
    r.to_chrome_trace(path)
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {k: f"rank {k}" for k in range(4)}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert all(threads[(k, 0)] == "compute" for k in range(4))
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == len(r.trace)
    assert all(e["dur"] >= 0 and (e["pid"], e["tid"]) in threads for e in spans)
    # No overlap within a thread (Perfetto's importer needs nesting).
    lanes = defaultdict(list)
    for e in spans:
        lanes[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for lane in lanes.values():
        lane.sort()
        assert all(a[1] <= b[0] + 1e-6 for a, b in zip(lane, lane[1:]))
    # Every send has one flow start; each flow id has one "s" and one "f", on different ranks.
    flows = defaultdict(dict)
    for e in events:
        if e["ph"] in ("s", "f"):
            assert e["ph"] not in flows[e["id"]]
            flows[e["id"]][e["ph"]] = e
    sends = r.trace[r.trace["op"].astype(str).str.startswith("SEND")]
    assert len(flows) == len(sends) > 0
    for pair in flows.values():
        assert set(pair) == {"s", "f"}
        assert pair["s"]["pid"] != pair["f"]["pid"] or s.placement_kind == "v"
        assert pair["f"]["ts"] >= pair["s"]["ts"]
        assert pair["f"]["bp"] == "e"


def test_gantt_draws_boxes_labels_and_memory(tmp_path):
    s = pipesim.build_schedule("interleaved", pp=2, vpp=2, microbatches=4)
    r = simulate(s, CostModel.uniform())
    fig = r.gantt(memory=True, comm=True)
    assert len(fig.axes) == 2
    ax = fig.axes[0]
    labels = Counter(t.get_text() for t in ax.texts)
    compute = r.trace[r.trace["kind"] == "compute"]
    # At this size every box holds its microbatch number.
    assert labels == Counter(str(mb) for mb in compute["microbatch"])
    assert ax.get_xlim() == (0.0, r.makespan)
    path = tmp_path / "g.png"
    fig.savefig(path)
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert not r.gantt(labels=False).axes[0].texts


def test_gantt_uses_no_pyplot():
    code = ("import sys, pipesim\n"
            "r = pipesim.simulate(pipesim.build_schedule('1f1b', pp=4, microbatches=8),\n"
            "                     pipesim.CostModel.uniform())\n"
            "r.gantt(memory=True)\n"
            "assert 'matplotlib.pyplot' not in sys.modules\n"
            "assert 'torch' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)
