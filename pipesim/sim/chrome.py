"""Chrome trace-event JSON from a trace, for chrome://tracing and https://ui.perfetto.dev.

Each rank is a process (``pid`` = rank, named "rank r"). Its threads: ``tid 0`` "compute", then
one thread per communication lane, "send -> rank k" and "recv <- rank k", so spans on one
thread never overlap (a directed link carries one transfer at a time, and a rank waits on one
receive at a time), which Perfetto's importer requires. Every span is a complete event
(``ph: "X"``); every SEND is tied to its RECV by a flow (``ph: "s"`` at the send's start,
``ph: "f"`` with ``bp: "e"`` at the receive's end). Times are microseconds.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

_US = 1e6


def _receiving_stage(op: str, stage: int) -> int:
    return stage + 1 if op == "SEND_F" else stage - 1


def chrome_trace(trace: "pd.DataFrame") -> dict:
    """The trace as ``{"traceEvents": [...], "displayTimeUnit": "ms"}``."""
    events: list[dict] = []
    lanes: dict[tuple[int, str], int] = {}
    lane_count: dict[int, int] = {}   # next free tid per rank
    t0 = float(trace["start"].min())
    has_peer = "peer" in trace.columns
    has_bytes = "bytes" in trace.columns
    sends: dict[tuple[str, int, int], tuple[int, int, float]] = {}
    recvs: dict[tuple[str, int, int], tuple[int, int, float]] = {}
    ranks = sorted(int(r) for r in trace["rank"].unique())
    for rank in ranks:
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0,
                       "args": {"sort_index": rank}})
        lanes[(rank, "compute")] = 0
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": 0,
                       "args": {"name": "compute"}})

    columns = ["rank", "op", "stage", "chunk", "microbatch", "start", "end", "kind"]
    extra = [c for c in ("bytes", "peer") if c in trace.columns]
    for row in trace[columns + extra].itertuples(index=False):
        rank, op, stage, chunk, mb, start, end, kind = (int(row[0]), str(row[1]), int(row[2]),
                                                        int(row[3]), int(row[4]), float(row[5]),
                                                        float(row[6]), str(row[7]))
        peer = int(getattr(row, "peer")) if has_peer else -1
        if kind == "compute":
            lane = "compute"
        elif op.startswith("SEND"):
            lane = f"send -> rank {peer}" if peer >= 0 else "send"
        elif op.startswith("RECV"):
            lane = f"recv <- rank {peer}" if peer >= 0 else "recv"
        elif op in ("UNSHARD", "RESHARD", "REDUCE_GRAD"):
            lane = "sharding (data-parallel)"     # ZeRO's actions, one lane
        else:
            lane = op.lower()
        tid = lanes.get((rank, lane))
        if tid is None:
            tid = lane_count.get(rank, 1)
            lane_count[rank] = tid + 1
            lanes[(rank, lane)] = tid
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                           "args": {"name": lane}})
        name = f"{stage}{op}{mb}" if stage >= 0 else op
        args = {"op": op, "stage": stage, "chunk": chunk, "microbatch": mb}
        if has_bytes and kind == "comm":
            args["bytes"] = float(getattr(row, "bytes"))
        ts = (start - t0) * _US
        events.append({"ph": "X", "name": name, "cat": kind, "pid": rank, "tid": tid,
                       "ts": ts, "dur": (end - start) * _US, "args": args})
        if op in ("SEND_F", "SEND_B"):
            sends[(op[-1], _receiving_stage(op, stage), mb)] = (rank, tid, ts)
        elif op in ("RECV_F", "RECV_B"):
            recvs[(op[-1], stage, mb)] = (rank, tid, (end - t0) * _US)

    for flow_id, (key, (rank, tid, ts)) in enumerate(sorted(sends.items())):
        if key not in recvs:
            continue
        d, stage, mb = key
        name = f"{d} {stage}:{mb}"
        events.append({"ph": "s", "id": flow_id, "name": name, "cat": "p2p", "pid": rank,
                       "tid": tid, "ts": ts})
        rrank, rtid, rts = recvs[key]
        events.append({"ph": "f", "bp": "e", "id": flow_id, "name": name, "cat": "p2p",
                       "pid": rrank, "tid": rtid, "ts": rts})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(data: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(data))
