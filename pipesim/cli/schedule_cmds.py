"""`pipesim list` and `pipesim show`: what schedules exist, and what one looks like."""
from __future__ import annotations

import argparse
import shutil

from ..schedule import build_schedule, schedule_info, schedule_names
from ..schedule.io import schedule_to_csv, schedule_to_json
from ..schedule.steps import unit_steps


def add_schedule_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="schedule name (see `pipesim list`)")
    p.add_argument("--pp", type=int, default=4, help="pipeline ranks")
    p.add_argument("--vpp", type=int, default=1, help="chunks (virtual stages) per rank")
    p.add_argument("--microbatches", "-m", type=int, default=8, help="microbatches per step")
    p.add_argument("--forward-only", action="store_true", help="inference: forwards only")


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("list", help="list schedules with their constraints")
    p.add_argument("--width", type=int, default=0,
                   help="wrap to this many columns (default: the terminal's, at most 100)")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("show", help="print a schedule's per-rank order as a time-step grid")
    add_schedule_args(p)
    p.add_argument("--with-comms", action="store_true",
                   help="also print each rank's full action list with SEND/RECV")
    p.add_argument("--width", type=int, default=0, help="terminal width (default: detected)")
    p.add_argument("--json", metavar="FILE", help="also write the schedule as JSON")
    p.add_argument("--csv", metavar="FILE", help="also write torch.distributed.pipelining CSV")
    p.set_defaults(func=cmd_show)


def cmd_list(args: argparse.Namespace) -> int:
    print(render_list(args.width or min(shutil.get_terminal_size((100, 24)).columns, 100)))
    return 0


def render_list(width: int = 100) -> str:
    """Every schedule: name, placement and constraints on its first lines, the description
    indented under them, all wrapped to ``width`` columns."""
    import textwrap

    infos = [schedule_info(n) for n in schedule_names()]
    w = max(len("name"), *(len(i.name) for i in infos))
    wp = max(len("placement"), *(len(i.placement) for i in infos))
    indent = " " * (w + 2)
    rest = max(20, width - w - wp - 4)
    out = [f"{'name':<{w}}  {'placement':<{wp}}  constraints", f"{indent}description", ""]
    for i in infos:
        cons = textwrap.wrap(i.constraints, rest) or [""]
        out.append(f"{i.name:<{w}}  {i.placement:<{wp}}  {cons[0]}")
        out += [f"{indent}{' ' * (wp + 2)}{c}" for c in cons[1:]]
        out += textwrap.wrap(i.description, max(20, width), initial_indent=indent,
                             subsequent_indent=indent)
        out.append("")
    return "\n".join(out).rstrip()


def render_grid(schedule, width: int) -> str:
    """Ranks as rows, unit time steps as columns, wrapped to ``width`` characters."""
    steps = unit_steps(schedule)
    span = max((t for row in steps for t, _ in row), default=-1) + 1
    cells = [["."] * span for _ in range(schedule.pp)]
    for rank, row in enumerate(steps):
        for t, a in row:
            cells[rank][t] = str(a)
    cw = max(len(c) for row in cells for c in row) if span else 1
    label = len(f"rank {schedule.pp - 1}")
    per_block = max(1, (width - label - 2) // (cw + 1))
    out = []
    for lo in range(0, span, per_block):
        hi = min(span, lo + per_block)
        out.append(" " * (label + 2) + " ".join(f"{t:<{cw}}" for t in range(lo, hi)))
        for rank in range(schedule.pp):
            out.append(f"{'rank ' + str(rank):<{label}}  " + " ".join(f"{c:<{cw}}" for c in cells[rank][lo:hi]))
        out.append("")
    busy = sum(len(r) for r in steps)
    out.append(f"{span} unit steps; busy {busy} of {span * schedule.pp} rank-steps "
               f"(bubble rate {1 - busy / (span * schedule.pp):.3f} with F=B=I=W=1, no communication cost)")
    return "\n".join(out)


def _routes_text(s) -> str:
    """Which stages each run of microbatches goes through, and which stages are copies."""
    runs: list[list] = []
    for mb in range(s.num_microbatches):
        r = (s.first_stage(mb), s.last_stage(mb))
        if runs and runs[-1][2] == r and runs[-1][1] == mb - 1:
            runs[-1][1] = mb
        else:
            runs.append([mb, mb, r])
    text = "routes: " + "; ".join(
        (f"microbatches {a}-{b}" if a != b else f"microbatch {a}") + f" through stages {f}..{l}"
        for a, b, (f, l) in runs)
    copies = [f"s{st}=part {s.stage_part(st)}" for st in range(s.num_stages)
              if s.stage_part(st) != st]
    if copies:
        text += "\ncopies (tied weights): " + ", ".join(copies)
    return text


def cmd_show(args: argparse.Namespace) -> int:
    s = build_schedule(args.name, pp=args.pp, microbatches=args.microbatches, vpp=args.vpp,
                       forward_only=args.forward_only).validate()
    width = args.width or shutil.get_terminal_size((120, 24)).columns
    print(f"{s.name}: pp={s.pp} vpp={s.vpp} microbatches={s.num_microbatches} "
          f"placement={s.placement_kind} ({', '.join(f's{st}->r{r}' for st, r in enumerate(s.placement))})")
    if s.has_routes or s.has_copies:
        print(_routes_text(s))
    print(render_grid(s, width))
    if args.with_comms:
        print("\nactions with communication:")
        for rank in range(s.pp):
            print(f"rank {rank}: " + " ".join(str(a) for a in s.actions(rank)))
    if args.json:
        schedule_to_json(s, args.json)
    if args.csv:
        schedule_to_csv(s, args.csv)
    return 0
