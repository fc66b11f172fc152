"""`pipesim plan`: search a cluster's configurations and pick the fastest plan that fits.

Prints the ranked table and why the winner won, writes every evaluated plan (``--out``, CSV or
Parquet), the best plan (``--plan-out``, the file ``pipesim simulate --plan`` reads), the
frontier picture and the best plan's Gantt chart with memory. Exits 1 when nothing fits, after
saying why for the closest plans.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..hardware import published_check_note
from ..plan.flags import DESTS, add_plan_flags, flatten, load_model, model_from_flags
from ..plan.parallelism import RECOMPUTE
from ..units import GiB, bytes_arg
from .plan_output import nothing_written_text, plan_gantt, summary_text, write_rows
from .lists import names

# the knobs `pipesim plan` searches (several values each); the table's other flags take one
SEARCHED = ("tp", "cp", "pp", "vpp", "ep", "ep_dispatcher", "dp", "zero", "recompute",
            "micro_batch_size")


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="search the configurations of a cluster; write the fastest "
                       "plan that fits", description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, required=True, metavar="N", help="GPUs in the cluster")
    p.add_argument("--hardware", default="H100", metavar="PRESET|FILE",
                   help="a preset (`pipesim hardware`) or a hardware file (pipeexec "
                        "calibrate-hardware --out FILE)")
    p.add_argument("--gpus-per-node", type=int, default=8, metavar="N",
                   help="GPUs per node (the NVLink domain tp stays inside)")
    p.add_argument("--memory-limit", metavar="SIZE", type=bytes_arg,
                   help="per-GPU memory limit with units, e.g. 80GiB, 75GB (default: the "
                        "hardware's memory)")
    p.add_argument("--schedules", type=names, nargs="+", metavar="A,B",
                   help="schedules to search (default: all but zb-auto)")
    p.add_argument("--zb-auto", type=int, default=0, metavar="K",
                   help="then search zb-auto's order on the best K layouts (vpp 1 or 2), from "
                        "each plan's costs under the same limit; a faster one becomes the best "
                        "plan, its schedule written into --plan-out as data (default 0: off)")
    add_plan_flags(p, defaults={"precision": "bf16", "cp_comm": "p2p"}, several=SEARCHED, group_titles={
        "layout": "parallel layout (the searched knobs take several values, comma- or "
                  "space-separated: --tp 1,2,4; defaults in `pipesim.planner.SearchSpace`; a "
                  "knob not searched is a filter or fixed)"})
    g = p.add_argument_group("search")
    g.add_argument("--tp-across-nodes", action="store_true",
                   help="let tp leave the NVLink domain")
    g.add_argument("--uneven", action=argparse.BooleanOptionalAction, default=True,
                   help="search near-even stages where layers do not divide over pp * vpp "
                        "(--no-uneven: Megatron's even split only)")
    g.add_argument("--efficiency", type=float, help="constant achieved/peak FLOP/s (default: "
                   "the per-operator model's, from the hardware's figures)")
    g.add_argument("--rate", "--compare", dest="rate", metavar="PLAN.json",
                   help="rate this plan (yours) against the best found, with the one-knob "
                        "differences that cost the most (--compare is the same flag; default: "
                        "none)")
    o = p.add_argument_group("output")
    o.add_argument("--top", type=int, default=10, help="rows of the ranked table (default 10)")
    o.add_argument("--out", metavar="FILE",
                   help="write every evaluated plan: .csv, or .parquet (needs pyarrow) "
                        "(default: none; only the files a flag names are written, and none "
                        "when nothing fits)")
    o.add_argument("--plan-out", metavar="FILE",
                   help="write the best plan, for `pipesim simulate --plan` (default: none)")
    o.add_argument("--frontier", metavar="PNG",
                   help="write the peak memory vs throughput picture (default: none)")
    o.add_argument("--gantt", metavar="PNG",
                   help="write the best plan's Gantt chart with memory (default: none)")
    o.add_argument("--jitter", type=float, metavar="J",
                   help="re-simulate the top plans with compute times x U[1-J, 1+J] and report "
                        "whether the order holds")
    o.add_argument("--robust", type=int, default=3, metavar="K",
                   help="re-rank the top K plans under the cost model's uncertainty "
                        "(efficiencies +-10%%, links +-20%%) and say when the order does not "
                        "hold (0: off)")
    o.add_argument("--jitter-seeds", type=int, default=5, metavar="K",
                   help="with --jitter: how many seeded re-simulations of the top plans")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    x = p.add_argument_group("execution")
    x.add_argument("--workers", type=int, metavar="K",
                   help="processes (default 1: in this process, the least CPU; every core's "
                        "pool is faster only on an idle machine)")
    x.add_argument("--dask", metavar="ADDRESS",
                   help="run on a Dask cluster (scheduler address; pip install "
                        "'dask[distributed]')")
    x.add_argument("--no-prune", action="store_true",
                   help="simulate every plan (brute force; for checking)")
    p.set_defaults(func=cmd_plan, parser=p)


def space_from_args(args: argparse.Namespace):
    """The search space the flags spell (--model and --global-batch-size required)."""
    from ..hardware import get_hardware
    from ..planner.enumerate import ALL_SCHEDULES, SearchSpace

    for dest, flag in (("model", "--model PRESET|config.json"), ("global_batch_size",
                                                                  "--global-batch-size B")):
        if getattr(args, dest) is None:
            raise ValueError(f"plan: give {flag}")
    given = {d for d in DESTS if getattr(args, d, None) is not None}
    model = model_from_flags(args, given - {"seq_len"}, load_model(args.model))
    return SearchSpace(
        model, gpus=args.gpus, gbs=args.global_batch_size, hardware=get_hardware(args.hardware),
        gpus_per_node=args.gpus_per_node, seq_length=args.seq_len,
        schedules=flatten(args.schedules) or ALL_SCHEDULES, tp=flatten(args.tp),
        cp=flatten(args.cp), pp=flatten(args.pp), vpp=flatten(args.vpp), ep=flatten(args.ep),
        dp=flatten(args.dp), microbatches=None if args.microbatches is None
        else (args.microbatches,),
        mbs=flatten(args.micro_batch_size) or (1, 2, 4),
        recompute=flatten(args.recompute) or RECOMPUTE,
        recompute_layers=args.recompute_layers, sequence_parallel=args.sequence_parallel,
        zero=flatten(args.zero) or (0, 1, 2, 3), ep_dispatcher=flatten(args.ep_dispatcher),
        precision=args.precision, cp_comm=args.cp_comm, tp_across_nodes=args.tp_across_nodes,
        overlap_tp_comm=bool(args.tp_comm_overlap),
        overlap_ep_comm=bool(args.overlap_moe_expert_parallel_comm),
        grad_reduce=args.grad_reduce or "per_step", grad_reduce_in_fp32=args.grad_reduce_in_fp32,
        uneven=args.uneven,
        efficiency=args.efficiency)


def cmd_plan(args: argparse.Namespace) -> int:
    from ..planner.explain import explain, explain_text
    from ..planner.search import search
    space = space_from_args(args)
    limit = args.memory_limit
    if args.top < 1:
        raise ValueError(f"--top must be >= 1, got {args.top}")
    if args.zb_auto < 0:
        raise ValueError(f"--zb-auto must be >= 0 layouts, got {args.zb_auto}")
    if args.jitter is not None and not 0 < args.jitter < 1:
        raise ValueError(f"--jitter must be in (0, 1), got {args.jitter}")
    out = Path(args.out) if args.out else None
    if out is not None and out.suffix not in (".csv", ".parquet"):
        raise ValueError(f"--out {args.out}: name a .csv or .parquet file")
    if out is not None and out.suffix == ".parquet" and not _has_pyarrow():
        raise ValueError(f"--out {args.out}: Parquet needs pyarrow (pip install pyarrow), or "
                         "name a .csv file")
    mine = _rated_plan(args.rate, space.gpus) if args.rate else None
    executor, client, workers = None, None, args.workers
    if args.dask:
        executor, client = _dask_executor(args.dask)
        if workers is None:                   # batches sized to the cluster's threads
            workers = max(1, sum(client.nthreads().values()))
    try:
        result = search(space, memory_limit=limit, top=args.top, workers=workers,
                        executor=executor, prune=not args.no_prune,
                        progress=not args.no_progress)
    finally:
        if client is not None:
            client.close()
    sp = space
    print(f"{sp.model.name} (seq {sp.model.seq_length}) on {sp.gpus} x {sp.hardware.name}, gbs "
          f"{sp.gbs}, memory limit {result.memory_limit / GiB:.1f} GiB")
    if sp.hardware.extrapolated and sp.efficiency is None:
        print(f"times extrapolated: {sp.hardware.name}'s efficiency figures are not calibrated "
              "(A100's fit, carried over or scaled by a microbenchmark); every step time and MFU "
              "below rests on them (pipeexec calibrate-hardware, then --hardware FILE)")
    note = published_check_note(sp.hardware, sp.model.is_moe) if sp.efficiency is None else ""
    if note:
        print(note)
    files = {"--out": args.out, "--plan-out": args.plan_out, "--frontier": args.frontier,
             "--gantt": args.gantt}
    ranked = result.ranked
    if not len(result.rows):
        print(summary_text(result).splitlines()[0])     # the refusals follow, on stderr
        print("\nno valid plan: every combination was refused", file=sys.stderr)
        for reason, n in result.refused.most_common():
            print(f"  {n:>6}  {reason}", file=sys.stderr)
        print(nothing_written_text(files))
        return 1
    if not len(ranked):
        print(summary_text(result))
        print(nothing_written_text(files))
        print("\nnothing fits: the closest plans", file=sys.stderr)
        for _, row in result.closest(3).iterrows():
            reason = row["reason"] or "(not simulated)"
            print(f"  {row['key']}: {reason}", file=sys.stderr)
        from ..planner.hints import fit_hints

        print("what would search plans keeping less memory:", file=sys.stderr)
        for hint in fit_hints(space, result.memory_limit, workers=args.workers):
            print(f"  {hint}", file=sys.stderr)
        return 1
    print()
    print(ranking_text(ranked, top=args.top))
    best = result.best
    best_row = ranked.iloc[0]
    print()
    print(explain_text(explain(result), best_row["key"], best_row["step_time"],
                       best_row["peak_memory"]))
    if mine is not None:
        from ..planner.rate import rate_plan

        print()
        print(rate_plan(mine, best, result.memory_limit).text())
    if args.zb_auto:
        from ..planner.refine import refine_with_zb_auto, refinement_text

        refinements = refine_with_zb_auto(result, args.zb_auto)
        print()
        print(refinement_text(refinements))
        won = [r for r in refinements
               if r.searched_step is not None and r.searched_step < best_row["step_time"]]
        if won:
            fastest = min(won, key=lambda r: r.searched_step)
            best = fastest.searched
            best_row = dict(best_row, key=f"zb-auto {fastest.base_key.split(' ', 1)[1]}")
            print(f"best: zb-auto's order on {fastest.base_key.split(' ', 1)[1]}, "
                  f"{fastest.searched_step:.4g} s a step against {ranked.iloc[0]['step_time']:.4g} "
                  f"s ({1 - fastest.searched_step / ranked.iloc[0]['step_time']:.1%} faster)")
    if args.robust and len(ranked) > 1:
        from ..planner.robustness import robustness_check

        top = ranked.head(args.robust)
        print()
        print(robustness_check([result.plans[k] for k in top["key"]], list(top["key"])).text())
    if args.jitter:
        from ..planner.stability import jitter_check

        top = ranked.head(args.top)
        report = jitter_check([result.plans[k] for k in top["key"]], list(top["key"]),
                              args.jitter, args.jitter_seeds)
        print()
        print(report.text())
    print()
    print(summary_text(result))    # after explain: the neighbours it simulated are counted too
    if out is not None:
        print(write_rows(result.rows, out))
    if args.plan_out:
        best.to_json(args.plan_out)
        print(f"wrote {args.plan_out}  (the best plan: pipesim simulate --plan {args.plan_out})")
    if args.frontier:
        from ..planner.frontier import frontier_figure

        frontier_figure(result).savefig(args.frontier, dpi=100)
        print(f"wrote {args.frontier}  (peak memory vs tokens/s of the {result.simulated:,} "
              "simulated plans)")
    if args.gantt:
        from ..sim.plan_report import simulate_plan

        plan_gantt(simulate_plan(best), best_row["key"]).savefig(args.gantt, dpi=100)
        print(f"wrote {args.gantt}  (the best plan's Gantt chart)")
    if not any(files.values()):
        print(nothing_written_text(files))
    return 0


def _rated_plan(path: str, gpus: int):
    """The plan ``--rate`` names, read before the search so a bad file fails at once."""
    from ..errors import PlanError
    from ..plan.plan import Plan

    try:
        mine = Plan.from_json(path)
    except PlanError as exc:
        raise ValueError(f"--rate {path}: {exc} (a plan file: pipesim simulate --save-plan or "
                         "pipesim plan --plan-out writes one)") from None
    if mine.world_size != gpus:
        raise ValueError(f"--rate {path}: the plan uses {mine.world_size} GPUs, the search "
                         f"{gpus}: give --gpus {mine.world_size}")
    return mine


def ranking_text(ranked, top: int | None = None) -> str:
    """The ranking as a table, ``top`` rows of it; a plan with the same step time and peak memory as the row above
    it (a twin: cp and the micro-batch size often trade off exactly) is counted on that row,
    not shown as a rank of its own. Memory in the unit that fits the largest peak."""
    import math

    from ..units import byte_unit, column_decimals

    scale, unit = byte_unit(float(ranked["peak_memory"].max()) if len(ranked) else GiB)
    lines = [f"{'#':>3} {'tokens/s/GPU':>12} {'MFU':>6} {'step s':>8} {'bubble':>7} "
             f"{'peak ' + unit:>8} {'headroom':>8}  config"]
    d = column_decimals(ranked["step_time"])
    shown, twins = [], []
    for _, r in ranked.iterrows():
        if shown and all(math.isclose(r[q], shown[-1][q], rel_tol=1e-9)
                         for q in ("step_time", "peak_memory")):
            twins[-1].append(r["key"])
            continue
        if top is not None and len(shown) == top:
            break
        shown.append(r)
        twins.append([])
    for i, (r, same) in enumerate(zip(shown, twins)):
        lines.append(f"{i + 1:>3} {r['tokens_per_s_per_gpu']:>12,.0f} {r['mfu']:>6.1%} "
                     f"{r['step_time']:>8.{d}f} {r['bubble_fraction']:>7.3f} "
                     f"{r['peak_memory'] / scale:>8.1f} {r['headroom'] / scale:>8.1f}  {r['key']}"
                     + (f"  (+{len(same)} twin{'s' * (len(same) > 1)} of the same time and "
                        f"memory: {', '.join(same)})" if same else ""))
    return "\n".join(lines)


def _has_pyarrow() -> bool:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return False
    return True


def _dask_executor(address: str):
    try:
        from distributed import Client
    except ImportError:
        raise ValueError("--dask needs Dask: pip install 'dask[distributed]' (or the pipesim "
                         "extra: pip install 'pipesim[plan]')") from None
    try:
        client = Client(address, timeout=30)
    except (OSError, TimeoutError) as exc:
        raise ValueError(f"--dask {address}: cannot reach the scheduler: {exc}") from None
    return client.get_executor(), client
