"""Plan-based simulation on the command line, and the ``models`` / ``hardware`` listings.

``pipesim simulate SCHEDULE --model llama3-70b --tp 8 --pp 4 --vpp 5 --dp 8 ...`` builds a
:class:`pipesim.Plan` from the flags (or reads one with ``--plan plan.json``), simulates it and
prints the report; ``--report-out`` writes it as JSON, ``--save-plan`` the plan. Plan mode is
on when ``--plan`` or any plan-only flag is given, or ``--model`` is not one of the GPT presets
that ``CostModel.transformer`` always served; otherwise ``simulate`` behaves as before.
"""
from __future__ import annotations

import argparse
import json

_PLAN_ONLY = ("plan", "tp", "cp", "ep", "global_batch_size", "seq_len", "recompute",
              "recompute_layers", "sequence_parallel", "distributed_optimizer", "zero",
              "precision", "gpus_per_node", "report_out", "save_plan", "no_flash_attention",
              "overlap_tp_comm", "no_overlap", "pipeline_layout")
_LEGACY_MODELS = ("tiny", "gpt3-1.3b", "gpt3-2.7b", "gpt3-6.7b", "gpt3-13b", "gpt3-175b")


def add_plan_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("plan (a real training configuration; see `pipesim models`, "
                             "`pipesim hardware`)")
    g.add_argument("--plan", metavar="PLAN.json", help="simulate this plan (other plan flags "
                   "override its fields)")
    g.add_argument("--tp", type=int, help="tensor-parallel size (default: 1, or the plan file's)")
    g.add_argument("--cp", type=int, help="context-parallel size (default: 1, or the plan file's)")
    g.add_argument("--ep", type=int, help="expert-parallel size, MoE models (default: 1, or the plan file's)")
    g.add_argument("--global-batch-size", type=int, metavar="B",
                   help="sequences per step (microbatches = B / (micro-batch-size * dp); default: from -m)")
    g.add_argument("--seq-len", type=int, metavar="S", help="training sequence length (default: the model's)")
    g.add_argument("--recompute", choices=("none", "selective", "full"),
                   help="activation recomputation (default: none, or the plan file's)")
    g.add_argument("--recompute-layers", type=int, metavar="N",
                   help="with --recompute full: recompute N layers of each stage (default: all)")
    g.add_argument("--sequence-parallel", action="store_true", default=None,
                   help="Megatron's sequence parallelism inside the tp group")
    g.add_argument("--distributed-optimizer", action="store_true", default=None,
                   help="Megatron's distributed optimizer (ZeRO-1)")
    g.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="optimizer sharding stage (default: 0, or the plan file's)")
    g.add_argument("--precision", choices=("bf16", "fp16", "fp8", "fp32"),
                   help="GEMM precision (default: bf16, or the plan file's)")
    g.add_argument("--gpus-per-node", type=int, metavar="N",
                   help="GPUs per node / NVLink domain (default: 8, or the plan file's)")
    g.add_argument("--no-flash-attention", action="store_true", default=None,
                   help="unfused attention (keeps the s x s scores)")
    g.add_argument("--overlap-tp-comm", action="store_true", default=None,
                   help="overlap tensor-parallel communication with the GEMMs")
    g.add_argument("--no-overlap", action="store_true", default=None,
                   help="expose the data-parallel gradient reduce and parameter gather")
    g.add_argument("--pipeline-layout", metavar="LAYOUT",
                   help="Megatron's --pipeline-model-parallel-layout, e.g. 'Et*3|(tt|)*29,m|L'")
    g.add_argument("--report-out", metavar="REPORT.json", help="write the report as JSON")
    g.add_argument("--save-plan", metavar="PLAN.json", help="write the plan simulated")


def wants_plan(args: argparse.Namespace) -> bool:
    if any(getattr(args, name, None) not in (None, False) for name in _PLAN_ONLY):
        return True
    model = getattr(args, "model", None)
    return model is not None and str(model).lower() not in _LEGACY_MODELS


def plan_from_args(args: argparse.Namespace, explicit: set[str]):
    """A Plan from --plan and/or the flags; ``explicit`` names the flags given on the line."""
    from ..plan.plan import Plan

    if args.plan:
        plan = Plan.load(args.plan)
    else:
        if not args.model:
            raise ValueError("plan mode needs --model PRESET|config.json (or --plan FILE)")
        if args.name is None:
            raise ValueError("give a SCHEDULE name (or --plan FILE)")
        plan = Plan.create(args.model, args.hardware or "H100")
    changes: dict = {}
    if args.name is not None:
        changes["schedule"] = args.name
    if args.model and args.plan:
        from ..plan.model import get_model

        changes["model"] = get_model(args.model)
    if args.hardware and (args.plan or "hardware" in explicit):
        from ..hardware import get_hardware

        changes["hardware"] = get_hardware(args.hardware)
    for flag, field in (("tp", "tp"), ("cp", "cp"), ("ep", "ep"), ("pp", "pp"), ("vpp", "vpp"),
                        ("dp", "dp"), ("micro_batch_size", "micro_batch_size"),
                        ("global_batch_size", "global_batch_size"), ("recompute", "recompute"),
                        ("recompute_layers", "recompute_layers"), ("zero", "zero"),
                        ("precision", "precision"), ("gpus_per_node", "gpus_per_node")):
        value = getattr(args, flag, None)
        if value is not None and (flag in explicit or not args.plan):
            changes[field] = value
    if args.sequence_parallel:
        changes["sequence_parallel"] = True
    if args.distributed_optimizer:
        if args.zero not in (None, 1):
            raise ValueError("--distributed-optimizer is ZeRO-1; it contradicts --zero "
                             f"{args.zero}")
        changes["zero"] = 1
    if args.no_flash_attention:
        changes["flash_attention"] = False
    if args.overlap_tp_comm:
        changes["overlap_tp_comm"] = True
    if args.no_overlap:
        changes.update(overlap_grad_reduce=False, overlap_param_gather=False)
    if args.efficiency is not None:
        changes["efficiency"] = args.efficiency
    if args.pipeline_layout:
        changes["partition_layout"] = args.pipeline_layout
    if "global_batch_size" not in changes and "microbatches" in explicit:
        par = plan.parallelism
        mbs = changes.get("micro_batch_size", par.micro_batch_size)
        changes["global_batch_size"] = args.microbatches * mbs * changes.get("dp", par.dp)
    elif "global_batch_size" not in changes and not args.plan:
        mbs = changes.get("micro_batch_size", 1)
        changes["global_batch_size"] = args.microbatches * mbs * changes.get("dp", 1)
    hardware = changes.pop("hardware", None)
    if hardware is not None:
        changes["cluster"] = plan.cluster.with_(hardware=hardware)
    plan = plan.with_(**changes)
    if args.seq_len:
        plan = plan.with_(model=plan.model.with_(seq_length=args.seq_len))
    return plan.validate()


def cmd_simulate_plan(args: argparse.Namespace, explicit: set[str]) -> int:
    from ..plan.report import simulate_plan

    plan = plan_from_args(args, explicit)
    result = simulate_plan(plan, comm=args.comm, validate=False)
    print(result.summary_text())
    if args.save_plan:
        plan.save(args.save_plan)
        print(f"wrote {args.save_plan}")
    if args.report_out:
        result.save(args.report_out)
        print(f"wrote {args.report_out}")
    if args.gantt:
        result.gantt(comm=args.gantt_comm, memory=True).savefig(args.gantt, dpi=100)
        print(f"wrote {args.gantt}")
    if args.chrome:
        result.to_chrome_trace(args.chrome)
        print(f"wrote {args.chrome}")
    if args.trace_csv:
        result.sim.trace.to_csv(args.trace_csv, index=False)
        print(f"wrote {args.trace_csv}")
    if args.save_costs:
        result.sim.costs.save(args.save_costs)
        print(f"wrote {args.save_costs}")
    return 0


def explicit_flags(argv) -> set[str]:
    """Destinations of the long options present on the command line."""
    out = set()
    for token in argv or ():
        if token.startswith("--"):
            out.add(token[2:].split("=")[0].replace("-", "_"))
        elif token == "-m":
            out.add("microbatches")
    return out


# -- listings ----------------------------------------------------------------------------------
def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list the model presets with their sizes")
    p.add_argument("--json", action="store_true", help="as JSON")
    p.set_defaults(func=cmd_models)
    p = sub.add_parser("hardware", help="list the hardware presets")
    p.add_argument("--json", action="store_true", help="as JSON")
    p.set_defaults(func=cmd_hardware)


def cmd_models(args: argparse.Namespace) -> int:
    from ..plan.model import PRESETS

    if args.json:
        print(json.dumps({k: {**m.to_dict(), "params": m.num_params()} for k, m in PRESETS.items()},
                         indent=2))
        return 0
    print(f"{'name':<18} {'params':>8} {'active':>8} {'layers':>6} {'hidden':>6} {'heads':>5} "
          f"{'kv':>3} {'ffn':>6} {'mlp':>6} {'experts':>8} {'seq':>6} {'vocab':>7}")
    for name, m in PRESETS.items():
        experts = f"{m.experts}/{m.top_k}" if m.is_moe else "-"
        print(f"{name:<18} {m.num_params() / 1e9:>7.2f}B {m.active_params() / 1e9:>7.2f}B "
              f"{m.layers:>6} {m.hidden:>6} {m.heads:>5} {m.num_kv_heads:>3} "
              f"{(m.moe_ffn if m.is_moe else m.ffn):>6} {m.mlp:>6} {experts:>8} "
              f"{m.seq_length:>6} {m.vocab:>7}")
    return 0


def cmd_hardware(args: argparse.Namespace) -> int:
    from ..hardware import get_hardware, hardware_names

    presets = [get_hardware(n) for n in hardware_names()]
    if args.json:
        print(json.dumps({h.name: h.to_dict() for h in presets}, indent=2))
        return 0
    print(f"{'name':<7} {'bf16 TFLOP/s':>12} {'fp8 TFLOP/s':>11} {'memory GB':>9} {'HBM TB/s':>8} "
          f"{'NVLink GB/s':>11} {'net GB/s':>8} {'NVLink domain':>13}")
    for h in presets:
        print(f"{h.name:<7} {h.peak_flops / 1e12:>12.1f} {h.fp8_peak_flops / 1e12:>11.1f} "
              f"{h.memory_bytes / 1e9:>9.0f} {h.hbm_bandwidth / 1e12:>8.2f} "
              f"{h.link_bandwidth / 1e9:>11.0f} {h.network_bandwidth / 1e9:>8.0f} "
              f"{h.nvlink_domain:>13}")
    return 0
