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
from pathlib import Path

from ..errors import PlanError
from ..plan.model import ModelSpec
from ..plan.flags import DESTS, apply_flags, load_model
from ..units import GiB

# Flags that only a plan can honour: given, they switch `simulate` from a schedule with
# uniform (or --costs) costs to a plan with derived costs.
_PLAN_ONLY = ("plan", "tp", "cp", "ep", "global_batch_size", "seq_len", "recompute",
              "recompute_layers", "recompute_modules", "offload_layers", "sequence_parallel", "distributed_optimizer", "zero",
              "grad_reduce", "grad_reduce_in_fp32",
              "precision", "gpus_per_node", "report_out", "save_plan", "no_flash_attention",
              "tp_comm_overlap", "overlap_tp_comm", "cp_comm", "no_overlap", "no_overlap_grad_reduce",
              "no_overlap_param_gather", "pipeline_layout", "layers", "hidden", "heads",
              "kv_heads", "ffn_hidden", "vocab", "tie_embeddings")
_LEGACY_MODELS = ("tiny", "gpt3-1.3b", "gpt3-2.7b", "gpt3-6.7b", "gpt3-13b", "gpt3-175b")
PLAN_RULE = ("--plan FILE is the base; every layout, batch or model flag given on the "
             "command line overrides that field of it")


def add_plan_args(p: argparse.ArgumentParser) -> None:
    """`simulate`'s flags beyond the shared table (`pipesim.plan.flags`): the plan file, the
    cluster, the overlap switches, the partition and the outputs of plan mode."""
    g = p.add_argument_group("plan (a real training configuration; see `pipesim models`, "
                             "`pipesim hardware`)")
    g.add_argument("--plan", metavar="PLAN.json", help=f"simulate this plan ({PLAN_RULE})")
    g.add_argument("--distributed-optimizer", action="store_true", default=None,
                   help="Megatron's distributed optimizer: --zero 1")
    g.add_argument("--gpus-per-node", type=int, metavar="N",
                   help="GPUs per node / NVLink domain (default: 8, or the plan file's)")
    g.add_argument("--no-flash-attention", action="store_true", default=None,
                   help="unfused attention (keeps the s x s scores)")
    g.add_argument("--overlap-tp-comm", action="store_true", default=None,
                   help="the same as --tp-comm-overlap (kept for older command lines)")
    g.add_argument("--no-overlap", action="store_true", default=None,
                   help="expose the data-parallel gradient reduce and parameter gather (both "
                        "of the next two)")
    g.add_argument("--no-overlap-grad-reduce", action="store_true", default=None,
                   help="expose the gradient reduce(-scatter): Megatron without "
                        "--overlap-grad-reduce (overlapped bucket by bucket by default)")
    g.add_argument("--no-overlap-param-gather", action="store_true", default=None,
                   help="expose the distributed optimizer's parameter all-gather: Megatron "
                        "without --overlap-param-gather")
    g.add_argument("--pipeline-layout", metavar="LAYOUT",
                   help="Megatron's --pipeline-model-parallel-layout, e.g. 'Et*3|(tt|)*29,m|L'")
    g.add_argument("--report-out", metavar="REPORT.json", help="write the report as JSON")
    g.add_argument("--save-plan", metavar="PLAN.json", help="write the plan simulated")


def wants_plan(args: argparse.Namespace, given: set[str]) -> bool:
    """Plan mode: a plan file, a flag only a plan honours, or a model beyond the GPT presets
    that `CostModel.transformer` serves."""
    # a table flag counts when given (simulate has defaults for some); the others when set
    if any(name in given or (name not in DESTS and getattr(args, name, None) not in (None, False))
           for name in _PLAN_ONLY):
        return True
    model = getattr(args, "model", None)
    return model is not None and str(model).lower() not in _LEGACY_MODELS


def plan_from_args(args: argparse.Namespace, given: set[str]):
    """A Plan from --plan and/or the flags; ``given``: the table's flags on the command line
    (they override the plan file's fields; without a file the command's defaults apply too)."""
    from ..hardware import get_hardware
    from ..plan.plan import Plan

    if args.plan:
        plan = Plan.from_json(args.plan)
        overriding = set(given)
    else:
        if not args.model:
            raise ValueError("plan mode needs --model PRESET|config.json (or --plan FILE)")
        if args.name is None:
            raise ValueError("give a SCHEDULE name (or --plan FILE)")
        plan = Plan.create(load_model(args.model), args.hardware or "H100")
        # simulate's defaults (pp 4, 8 microbatches...) hold where no flag is given
        overriding = set(given) | {d for d in ("pp", "vpp", "dp", "micro_batch_size")
                                   if getattr(args, d, None) is not None}
        if "global_batch_size" not in given:
            overriding.add("microbatches")
    plan = apply_flags(plan, args, overriding)
    changes: dict = {}
    if args.name is not None:
        changes["schedule"] = args.name
    if args.hardware and (args.plan or "hardware" in given):
        changes["cluster"] = plan.cluster.with_(hardware=get_hardware(args.hardware))
    if args.gpus_per_node is not None:
        changes["gpus_per_node"] = args.gpus_per_node
    if args.distributed_optimizer:
        if args.zero not in (None, 1):
            raise ValueError("--distributed-optimizer is ZeRO-1; it contradicts --zero "
                             f"{args.zero}")
        changes["zero"] = 1
    if args.no_flash_attention:
        changes["flash_attention"] = False
    if args.overlap_tp_comm:
        changes["overlap_tp_comm"] = True
    if args.no_overlap or args.no_overlap_grad_reduce:
        changes["overlap_grad_reduce"] = False
    if args.no_overlap or args.no_overlap_param_gather:
        changes["overlap_param_gather"] = False
    if args.efficiency is not None:
        changes["efficiency"] = args.efficiency
    if args.pipeline_layout:
        changes["partition_layout"] = args.pipeline_layout
    cluster = changes.pop("cluster", None)
    if cluster is not None:
        plan = plan.with_(cluster=cluster)
    return plan.with_(**changes).validate()


def cmd_simulate_plan(args: argparse.Namespace, explicit: set[str]) -> int:
    from ..sim.plan_report import simulate_plan

    plan = plan_from_args(args, explicit)
    result = simulate_plan(plan, comm=args.comm, validate=False)
    print(result.summary_text())
    if args.save_plan:
        plan.to_json(args.save_plan)
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


# -- listings ----------------------------------------------------------------------------------
def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list the model presets with their sizes; with a name and "
                       "--config-out DIR, write that preset as a Hugging Face config.json")
    p.add_argument("name", nargs="?", help="one preset (default: all)")
    p.add_argument("--json", action="store_true", help="as JSON")
    p.add_argument("--config-out", metavar="DIR",
                   help="write the preset's Hugging Face config.json into DIR (made if absent), "
                   "so that `pipeexec train --hf-model DIR` or a plan made with --model DIR "
                   "runs it as that family's transformers model")
    p.add_argument("--force", action="store_true", help="with --config-out: overwrite DIR/config.json")
    p.set_defaults(func=cmd_models)
    p = sub.add_parser("hardware", help="list the hardware presets")
    p.add_argument("--json", action="store_true", help="as JSON")
    p.set_defaults(func=cmd_hardware)


def cmd_models(args: argparse.Namespace) -> int:
    from ..plan.model import PRESETS, get_model

    if args.config_out is not None:
        if args.name is None:
            raise PlanError("pipesim models --config-out DIR: name the preset to write, e.g. "
                            "pipesim models llama3-8b --config-out llama3-8b")
        return write_config(get_model(args.name), args.config_out, force=args.force)
    presets = PRESETS if args.name is None else {args.name: get_model(args.name)}
    if args.json:
        print(json.dumps({k: {**m.to_dict(), "params": m.num_params()} for k, m in presets.items()},
                         indent=2))
        return 0
    print(f"{'name':<18} {'params':>8} {'active':>8} {'layers':>6} {'hidden':>6} {'heads':>5} "
          f"{'kv':>3} {'ffn':>6} {'mlp':>6} {'experts':>8} {'seq':>6} {'vocab':>7}")
    for name, m in presets.items():
        experts = f"{m.experts}/{m.top_k}" if m.is_moe else "-"
        print(f"{name:<18} {m.num_params() / 1e9:>7.2f}B {m.active_params() / 1e9:>7.2f}B "
              f"{m.layers:>6} {m.hidden:>6} {m.heads:>5} {m.num_kv_heads:>3} "
              f"{(m.moe_ffn if m.is_moe else m.ffn):>6} {m.mlp:>6} {experts:>8} "
              f"{m.seq_length:>6} {m.vocab:>7}")
    return 0


def write_config(model: "ModelSpec", out: str, *, force: bool = False) -> int:
    """Write ``model`` (a preset that is a Hugging Face family) as ``out/config.json``."""
    from ..plan.hf_config import hf_config_for

    if model.family is None:
        raise PlanError(f"model {model.name!r} is no Hugging Face family: it has no config.json "
                        "to write")
    path = Path(out) / "config.json"
    if path.exists() and not force:
        raise PlanError(f"{path} exists; give --force to overwrite it, or another DIR")
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(hf_config_for(model), indent=2, sort_keys=True) + "\n"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    print(f"wrote {path} ({model.family}, {model.num_params() / 1e9:.2f}B parameters); plan it "
          f"with --model {out}, or train it with pipeexec train --hf-model {out}")
    return 0


def cmd_hardware(args: argparse.Namespace) -> int:
    from ..hardware import get_hardware, hardware_names

    presets = [get_hardware(n) for n in hardware_names()]
    if args.json:
        print(json.dumps({h.name: h.to_dict() for h in presets}, indent=2))
        return 0
    # efficiencies: "fitted" (A100, on Korthikanti Table 5 + Narayanan Table 1), "extrapolated"
    # (carried over from it: the times printed for that hardware say so); `--json` has sources
    print(f"{'name':<7} {'bf16 TFLOP/s':>12} {'fp8 TFLOP/s':>11} {'nvfp4 TFLOP/s':>13} "
          f"{'memory GiB':>10} {'HBM TB/s':>8} "
          f"{'NVLink GB/s':>11} {'net GB/s':>8} {'NVLink domain':>13} {'efficiencies':>12}")
    for h in presets:
        fp8 = f"{h.fp8_peak_flops / 1e12:.1f}" if h.has_fp8 else "-"       # A100: no FP8
        fp4 = f"{h.nvfp4_flops / 1e12:.1f}" if h.nvfp4_flops else "-"      # Blackwell only
        print(f"{h.name:<7} {h.peak_flops / 1e12:>12.1f} {fp8:>11} {fp4:>13} "
              f"{h.memory_bytes / GiB:>10.1f} {h.hbm_bandwidth / 1e12:>8.2f} "
              f"{h.link_bandwidth / 1e9:>11.0f} {h.network_bandwidth / 1e9:>8.0f} "
              f"{h.nvlink_domain:>13} {h.calibration:>12}")
    return 0
