"""`pipesim simulate` and `pipesim sweep`: predict a step's time and memory from the command line."""
from __future__ import annotations

import argparse
import sys

from ..plan.costs import CostModel
from ..hardware import hardware_names
from ..schedule.placement import PLACEMENTS
from ..plan.flags import DESTS, add_plan_flags, flatten, given_dests
from ..units import UNITS_HELP, byte_unit, bytes_arg, format_bytes
from .lists import SCHEDULES_HELP, names
from .plan_cmds import add_plan_args, cmd_simulate_plan, wants_plan

# simulate's own defaults for the table's flags: a pipeline of 4 ranks and 8 microbatches
SIMULATE_DEFAULTS = {"pp": 4, "vpp": 1, "dp": 1, "microbatches": 8, "micro_batch_size": 1}
# the table's flags `pipesim sweep` takes (several values each but dp, which --step-tail reads)
SWEEP_DESTS = ("pp", "vpp", "dp", "microbatches", "micro_batch_size", "model")


class _Typed(list):
    """A several-values flag's default, shown in --help as it is typed (``4``, not ``[(4,)]``)."""

    def __str__(self) -> str:
        return " ".join(",".join(map(str, t)) if isinstance(t, tuple) else str(t) for t in self)


def _add_cost_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("costs (default: uniform F=1, B=2 (I=W=1), zero communication)")
    g.add_argument("--costs", metavar="FILE.json", help="a CostModel saved as JSON")
    g.add_argument("--hardware", metavar="PRESET|FILE", default=None,
                   help=f"{', '.join(hardware_names())} (default H100; `pipesim hardware`), or "
                        "a hardware file (pipeexec calibrate-hardware --out FILE)")
    g.add_argument("--efficiency", type=float, default=None,
                   help="achieved / peak FLOP/s (default 0.5; with a plan, the per-operator model's)")
    g.add_argument("--link", choices=("intra", "inter"), default="inter",
                   help="pipeline p2p over NVLink (intra) or the network (inter)")
    g.add_argument("--comm", choices=("async", "blocking", "rendezvous"), default="async",
                   help="async: receives count as pre-posted; rendezvous: a transfer starts "
                        "once both sides have posted (gloo, NCCL)")
    g.add_argument("--recv-lookahead", type=int, default=0, metavar="K",
                   help="post each receive K computations before the one that needs it")
    g.add_argument("--cores", type=float, default=None,
                   help="the ranks share this many processors (costs are then work)")
    g.add_argument("--step-tail", action="store_true",
                   help="add the dp gradient all-reduce and the optimizer step")


def _cost_source(args: argparse.Namespace):
    """A CostModel, or a (num_stages, micro_batch_size) -> CostModel factory for --model."""
    if args.costs and args.model:
        raise ValueError("give either --costs or --model, not both")
    if args.hardware:
        from ..hardware import get_hardware

        get_hardware(args.hardware)         # a misspelled preset is named before anything else
        if not args.model:
            raise ValueError("--hardware needs --model")
    if args.costs:
        return CostModel.load(args.costs)
    if args.model:
        hw = args.hardware or "H100"

        def factory(num_stages: int, micro_batch_size: int) -> CostModel:
            return CostModel.transformer(args.model, hw, num_stages=num_stages,
                                         micro_batch_size=micro_batch_size,
                                         efficiency=0.5 if args.efficiency is None
                                         else args.efficiency, link=args.link)
        return factory
    return CostModel.uniform(1.0, 2.0)


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="simulate one step of a schedule and print its summary")
    p.add_argument("name", nargs="?", help="schedule name (see `pipesim list`), or a schedule "
                   "file: our FILE.json or torch's FILE.csv (its pp, vpp, m are the file's)")
    add_plan_flags(p, defaults=SIMULATE_DEFAULTS)
    p.add_argument("--forward-only", action="store_true", help="inference: forwards only")
    p.add_argument("--memory-limit", type=bytes_arg, default=None, metavar="BYTES",
                   help="zb-auto: per-rank memory limit its search keeps under (e.g. 40GB)")
    p.add_argument("--placement", choices=PLACEMENTS, default=None,
                   help="zb-auto at --vpp 2: search only this placement of the stages (default: "
                   "both, the faster kept)")
    _add_cost_args(p)
    p.add_argument("--jitter", type=float, default=0.0, help="relative compute-time noise, seeded")
    p.add_argument("--seed", type=int, default=0, help="seed of --jitter")
    p.add_argument("--gantt", metavar="OUT.png", help="write a Gantt chart")
    p.add_argument("--gantt-comm", action="store_true", help="with a communication lane")
    p.add_argument("--chrome", metavar="OUT.json", help="write a Chrome/Perfetto trace")
    p.add_argument("--trace-csv", metavar="OUT.csv", help="write the trace table")
    p.add_argument("--save-costs", metavar="OUT.json", help="write the cost model used")
    add_plan_args(p)
    p.set_defaults(func=cmd_simulate, parser=p)

    p = sub.add_parser("sweep", help="simulate schedules x pp x vpp x microbatches, write CSV")
    p.add_argument("--schedules", type=names, nargs="+", required=True, metavar="A,B",
                   help=SCHEDULES_HELP)
    add_plan_flags(p, defaults={"pp": _Typed([(4,)]), "vpp": _Typed([(1,)]),
                                "microbatches": _Typed([(8,)]),
                                "micro_batch_size": _Typed([(1,)]), "dp": 1},
                   several=("pp", "vpp", "microbatches", "micro_batch_size"),
                   omit=tuple(d for d in DESTS if d not in SWEEP_DESTS))
    _add_cost_args(p)
    p.add_argument("--memory-limit", type=bytes_arg, default=None,
                   help=f"per-rank peak memory limit with its unit, e.g. 80GB, 72GiB ({UNITS_HELP}; "
                        "default with --model: the hardware's usable memory, as `pipesim plan` "
                        "reads it: its capacity less the reserve, over the fragmentation)")
    p.add_argument("--inflight-limit", type=int, default=None,
                   help="per-rank limit on microbatches in flight")
    p.add_argument("--out", metavar="OUT.csv", required=True, help="CSV of every configuration")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_sweep, parser=p)


def cmd_simulate(args: argparse.Namespace) -> int:
    from ..sim.engine import simulate
    from ..schedule.registry import build_schedule

    given = given_dests(args.parser, args.command_argv)
    if wants_plan(args, given):
        return cmd_simulate_plan(args, given)
    if args.name is None:
        raise ValueError("give a SCHEDULE name (see `pipesim list`) or file, or --plan FILE")
    source = _cost_source(args)
    if args.name.endswith((".json", ".csv")):
        from ..schedule.io import schedule_from_csv, schedule_from_json

        load = schedule_from_json if args.name.endswith(".json") else schedule_from_csv
        schedule = load(args.name).validate()
        if args.recv_lookahead and schedule.has_explicit_comms:
            raise ValueError(f"{args.name}: --recv-lookahead moves inserted receives; this file "
                             "places its SEND/RECV actions itself")
        schedule = schedule.with_recv_lookahead(args.recv_lookahead)
        for flag, value in (("--forward-only", args.forward_only),
                            ("--memory-limit", args.memory_limit), ("--placement", args.placement)):
            if value:
                raise ValueError(f"{args.name}: {flag} applies to a named schedule; a file "
                                 "holds its own actions")
    else:
        options = {}
        if args.name == "zb-auto":      # its search needs the costs it will be simulated with
            options = {"memory_limit": args.memory_limit, "placement": args.placement,
                       "costs": source(args.pp * args.vpp, args.micro_batch_size)
                       if callable(source) else source}
        elif args.memory_limit is not None or args.placement is not None:
            raise ValueError(f"--{'memory-limit' if args.placement is None else 'placement'} "
                             "applies to zb-auto only (the other schedules fix their own)")
        schedule = build_schedule(args.name, pp=args.pp, microbatches=args.microbatches,
                                  vpp=args.vpp, forward_only=args.forward_only,
                                  recv_lookahead=args.recv_lookahead, **options)
    # per model part (a copy of a part, as in dualpipe, costs what the part costs)
    costs = source(schedule.num_parts, args.micro_batch_size) if callable(source) else source
    result = simulate(schedule, costs, comm=args.comm, step_tail=args.step_tail, dp=args.dp,
                      jitter=args.jitter, seed=args.seed, cores=args.cores)
    unitless = not (args.costs or args.model)
    print(result.summary_text(unitless=unitless))
    parts_per_rank = schedule.num_parts // schedule.pp
    if unitless and parts_per_rank > 1:
        print(per_stage_note(parts_per_rank))
    if args.gantt:
        result.gantt(comm=args.gantt_comm, memory=True,
                     unitless=unitless).savefig(args.gantt, dpi=100)
        print(f"wrote {args.gantt}")
    if args.chrome:
        result.to_chrome_trace(args.chrome)
        print(f"wrote {args.chrome}")
    if args.trace_csv:
        result.trace.to_csv(args.trace_csv, index=False)
        print(f"wrote {args.trace_csv}")
    if args.save_costs:
        costs.save(args.save_costs)
        print(f"wrote {args.save_costs}")
    return 0


def per_stage_note(parts_per_rank: int) -> str:
    """Why default-cost makespans at vpp > 1 are not comparable with vpp = 1's."""
    return (f"note: the default costs are per stage (F=1, B=2 each): with vpp = {parts_per_rank} "
            f"a rank holds {parts_per_rank} stages and does {parts_per_rank}x the work of vpp = 1 "
            "(the README's schedule table divides them by vpp)")


def cmd_sweep(args: argparse.Namespace) -> int:
    from ..hardware import get_hardware
    from ..sim.sweep import sweep

    source = _cost_source(args)
    limit = args.memory_limit
    if limit is None and args.model:            # the limit `pipesim plan` holds a plan to
        hw = get_hardware(args.hardware or "H100")
        limit = hw.usable_memory
        print(f"memory limit {format_bytes(limit)}: {hw.name}'s usable memory, "
              f"{format_bytes(hw.memory_bytes)} less a {format_bytes(hw.reserve)} reserve, over "
              f"fragmentation x{hw.fragmentation:g} (--memory-limit to change)")
    table = sweep(flatten(args.schedules), flatten(args.pp), flatten(args.vpp),
                  flatten(args.microbatches), flatten(args.micro_batch_size),
                  costs=source, memory_limit=limit, inflight_limit=args.inflight_limit,
                  comm=args.comm, step_tail=args.step_tail, dp=args.dp,
                  recv_lookahead=args.recv_lookahead, cores=args.cores,
                  progress=not args.no_progress)
    table.to_csv(args.out, index=False)
    ok = table[table["status"] == "ok"].sort_values("makespan")
    shown = ["schedule", "pp", "vpp", "microbatches", "micro_batch_size", "makespan",
             "bubble_fraction", "bubble_rate", "peak_memory", "peak_inflight"]
    if len(ok):
        view = ok[shown]
        if args.costs or args.model:
            scale, name = byte_unit(float(view["peak_memory"].max()))
            view = view.assign(peak_memory=view["peak_memory"] / scale).rename(
                columns={"peak_memory": f"peak_memory_{name}", "makespan": "makespan_s"})
        # rounding noise (a zero bubble_rate computed as 5.55e-17) is shown as 0
        print(view.to_string(index=False,
                             float_format=lambda x: "0" if abs(x) < 1e-12 else f"{x:.5g}"))
    for row in table[table["status"] == "infeasible"].itertuples(index=False):
        print(f"infeasible: {row.schedule} pp={row.pp} vpp={row.vpp} m={row.microbatches} "
              f"mbs={row.micro_batch_size}: {row.reason}", file=sys.stderr)
    invalid = table[table["status"] == "invalid"]
    for (name, reason), group in invalid.groupby(["schedule", "reason"], sort=False):
        print(f"invalid ({len(group)} configuration{'s' if len(group) > 1 else ''}): {name}: "
              f"{reason}", file=sys.stderr)
    unitless = not (args.costs or args.model)
    if unitless and len(ok) and (ok["vpp"] > 1).any():
        print(per_stage_note(int(ok["vpp"].max())).replace(
            "note:", "note: makespans at vpp > 1 are not comparable with vpp = 1's here:", 1))
    print(f"{len(ok)} of {len(table)} configurations feasible; wrote {args.out}")
    if len(ok) == 0:
        return 1
    return 0
