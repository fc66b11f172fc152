"""Schedules to and from files: our JSON, and torch.distributed.pipelining's CSV.

The CSV format is torch's ``_dump_csv`` / ``_load_csv``: one row per rank, one compact action per
cell (``2F5``); empty cells are idle slots and are skipped. A compute-only CSV gets its
communication inserted here; a CSV that holds SEND/RECV cells ("compute_comms") is taken as is.
The CSV carries no placement or microbatch count, so both are inferred from the actions.
It cannot say that a microbatch skips stages or that two stages are copies of one model part
(DualPipe), so such a schedule is refused there; the JSON keeps ``routes`` (first and last
stage of each microbatch) and ``stage_parts``.

Sharding (ZeRO as actions, :mod:`pipesim.schedule.sharding`): the JSON keeps a schedule's
``sharding`` (``{"zero": 3, "grad_reduce": "per_step"}``, its actions inserted again on
load); the CSV with communication writes the inserted ``UNSHARD`` / ``RESHARD`` /
``REDUCE_GRAD`` cells, as torch's "compute_comms" CSV does, and reads them back as hand-placed
actions (torch's ``0UNSHARD``, without a microbatch, too). A compute-only CSV holds none.
"""
from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path

from ..errors import ScheduleError
from .action import Action
from .schedule import Schedule
from .sharding import Sharding, insert_sharding

FORMAT = "pipesim.schedule"
VERSION = 1


def schedule_to_dict(schedule: Schedule) -> dict:
    ranks = range(schedule.pp)
    data = {
        "format": FORMAT,
        "version": VERSION,
        "name": schedule.name,
        "pp": schedule.pp,
        "vpp": schedule.vpp,
        "microbatches": schedule.num_microbatches,
        "placement": list(schedule.placement),
        "forward_only": schedule.forward_only,
    }
    if schedule.recv_lookahead:
        data["recv_lookahead"] = schedule.recv_lookahead
    if schedule.routes is not None:
        data["routes"] = [list(r) for r in schedule.routes]      # [first, last] stage per microbatch
    if schedule.stage_parts is not None:
        data["stage_parts"] = list(schedule.stage_parts)
    if schedule.sharding is not None:
        data["sharding"] = schedule.sharding.to_dict()
    if schedule.has_explicit_comms:
        plain = schedule.with_sharding(None)        # the sharding's actions: inserted on load
        data["actions"] = [[str(a) for a in plain.actions(r)] for r in ranks]
    else:
        data["compute"] = [[str(a) for a in schedule.compute_order(r)] for r in ranks]
    return data


def schedule_from_dict(data: dict, source: str = "schedule") -> Schedule:
    if data.get("format") != FORMAT:
        raise ScheduleError(f"{source}: field 'format' is {data.get('format')!r}, expected {FORMAT!r}")
    if data.get("version") != VERSION:
        raise ScheduleError(f"{source}: field 'version' is {data.get('version')!r}, expected {VERSION}")
    for field in ("pp", "vpp", "microbatches", "placement"):
        if field not in data:
            raise ScheduleError(f"{source}: missing field {field!r}")
    if "actions" not in data and "compute" not in data:
        raise ScheduleError(f"{source}: missing field 'compute' (or 'actions')")
    lists = data["actions"] if "actions" in data else data["compute"]
    try:
        return Schedule(
            data["pp"], data["vpp"], data["microbatches"], data["placement"],
            [[Action.parse(t) for t in row] for row in lists],
            name=data.get("name", "custom"), forward_only=data.get("forward_only", False),
            recv_lookahead=data.get("recv_lookahead", 0), routes=data.get("routes"),
            stage_parts=data.get("stage_parts"),
            sharding=Sharding.from_dict(data["sharding"]) if data.get("sharding") else None)
    except ScheduleError as exc:
        raise ScheduleError(f"{source}: {exc}") from None


def schedule_to_json(schedule: Schedule, path: str | os.PathLike | None = None) -> str:
    """Serialise ``schedule``; also write it to ``path`` when given. Returns the JSON text."""
    text = json.dumps(schedule_to_dict(schedule), indent=1)
    if path is not None:
        Path(path).write_text(text + "\n")
    return text


def schedule_from_json(source: str | os.PathLike) -> Schedule:
    """Load a schedule from a JSON file path, or from JSON text."""
    text, where = _read(source, "{")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ScheduleError(f"{where}: not valid JSON: {exc}") from None
    return schedule_from_dict(data, where)


def schedule_to_csv(schedule: Schedule, path: str | os.PathLike | None = None,
                    *, with_comms: bool = False) -> str:
    """torch.distributed.pipelining's CSV: one row per rank. Returns the text.

    ``with_comms``: torch's "compute_comms" format, the SEND/RECV actions included, with the
    receives ordered as torch's runtime needs them (one untagged channel per pair of ranks:
    :func:`pipesim.schedule.torch_order.single_channel_actions`); hand-placed communication
    that breaks that order is refused with the transfer that breaks it.
    """
    if schedule.has_routes or schedule.has_copies:
        raise ScheduleError(
            f"schedule {schedule.name!r} cannot be written as torch.distributed.pipelining's CSV: "
            "its microbatches take different routes through the stages (or stages are copies of "
            "one model part), which torch's format and runtime cannot express (every microbatch "
            "goes through every stage there); write it with schedule_to_json instead")
    rows = None
    if with_comms:
        from .torch_order import single_channel_actions

        rows = single_channel_actions(schedule)
        if schedule.sharding is not None and not schedule.has_explicit_comms:
            rows = [insert_sharding(row, schedule.sharding) for row in rows]
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for rank in range(schedule.pp):
        row = rows[rank] if rows is not None else schedule.compute_order(rank)
        writer.writerow([str(a) for a in row])
    text = buf.getvalue()
    if path is not None:
        Path(path).write_text(text)
    return text


def schedule_from_csv(source: str | os.PathLike, *, name: str = "custom",
                      vpp: int | None = None) -> Schedule:
    """Load torch's CSV (a file path or the text). Placement and microbatch count are inferred."""
    text, where = _read(source, ",")
    rows = [[c for c in row if c.strip()] for row in csv.reader(io.StringIO(text))]
    while rows and not rows[-1]:
        rows.pop()
    if not rows:
        raise ScheduleError(f"{where}: no rows")
    orders = []
    for rank, row in enumerate(rows):
        try:
            orders.append([Action.parse(c) for c in row])
        except ScheduleError as exc:
            raise ScheduleError(f"{where}: row {rank} (rank {rank}): {exc}") from None
    pp = len(orders)
    stage_rank: dict[int, int] = {}
    max_mb = -1
    for rank, order in enumerate(orders):
        for a in order:
            if stage_rank.setdefault(a.stage, rank) != rank:
                raise ScheduleError(f"{where}: stage {a.stage} appears on ranks {stage_rank[a.stage]} "
                                    f"and {rank}; a stage lives on one rank")
            max_mb = max(max_mb, a.microbatch)
    num_stages = max(stage_rank, default=-1) + 1
    missing = [s for s in range(num_stages) if s not in stage_rank]
    if missing or max_mb < 0:
        raise ScheduleError(f"{where}: stages {missing or 'all'} have no actions, so their rank is unknown")
    if vpp is None:
        if num_stages % pp:
            raise ScheduleError(f"{where}: {num_stages} stages over {pp} ranks is not a whole number per rank")
        vpp = num_stages // pp
    forward_only = all(a.op in ("F", "SEND_F", "RECV_F", "UNSHARD", "RESHARD")
                       for o in orders for a in o)
    return Schedule(pp, vpp, max_mb + 1, [stage_rank[s] for s in range(num_stages)], orders,
                    name=name, forward_only=forward_only)


def _read(source: str | os.PathLike, marker: str) -> tuple[str, str]:
    """(text, name for errors): a path is read; a string that looks like content is used as is."""
    if isinstance(source, str) and not os.path.exists(source) and (marker in source or "\n" in source):
        return source, "schedule text"
    path = Path(source)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ScheduleError(f"{path}: no such file") from None
    except OSError as exc:
        raise ScheduleError(f"{path}: cannot read the schedule file ({exc.strerror or exc})") from None
    try:
        return raw.decode("utf-8"), str(path)
    except UnicodeDecodeError as exc:
        raise ScheduleError(f"{path}: not a schedule file: byte {exc.start} is "
                            f"{raw[exc.start]:#04x}, not UTF-8 text") from None
