"""``pipeexec compare``: run a schedule with profiling in local workers, compare it with its
simulation, print the table and write the report, table, picture and trace files."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pipesim
from pipesim.cli.help import DefaultsHelpFormatter
from pipesim.plan.flags import DESTS, add_plan_flags
from pipesim.units import byte_unit

from ..analysis.compare import Comparison, compare_runs
from ..analysis.measured_run import MeasuredRun
from ..analysis.plan_memory import predicted_activation_peaks
from ..analysis.predict import layout_of, predict, program_of
from ..analysis.run_description import inherit
from ..config import ConfigError
from ..measuring.profile_options import ProfileOptions
from ..models.hf_config import HF_FIELDS
from ..flag_fields import values_from_args
from .given import GivenFlagsParser
from .train import PLAN_DESTS, _shown_defaults, config_from_args, train_parser

# The executor (run, launching, measuring: torch and the training stack) is imported by the
# functions that run it, so `pipeexec --help` and flag errors do not load it.


# compare's own default where train's would make a toy (one step).
DEFAULT_STEPS = 6          # steps 1..5 profiled: the central 3 are compared
# The model compare runs when neither a flag nor a calibration run sets it: the benchmark's.
DEFAULT_MODEL = {"layers": 6, "hidden": 256, "heads": 4, "seq_len": 128, "micro_batch_size": 4}


def default_plan() -> Any:
    """pipeexec's base plan with compare's default model and micro-batch (the messages a
    compare run sends: `pipeexec.measuring.collectives.run_message_sizes`)."""
    from ..config import DEFAULT_PLAN
    shape = dict(layers=DEFAULT_MODEL["layers"], hidden=DEFAULT_MODEL["hidden"],
                 heads=DEFAULT_MODEL["heads"], seq_length=DEFAULT_MODEL["seq_len"])
    return DEFAULT_PLAN.with_(model=DEFAULT_PLAN.model.with_(**shape),
                              micro_batch_size=DEFAULT_MODEL["micro_batch_size"])


def profiled_run(config: Any, first: int, stop: int, *, trace_out: str | None = None,
                 timeout: float | None = None, cpus_per_rank: float | None = None,
                 profile: ProfileOptions | None = None) -> MeasuredRun:
    """Train ``config`` in local forked workers, profiling steps ``first..stop-1``; return the
    gathered run (written to ``trace_out`` too, when given). ``cpus_per_rank``: as for
    `pipeexec.launching.launcher.launch`; ``profile``: the other profiling options (clock
    alignment, split probe), default `ProfileOptions`' defaults."""
    from ..launching.devices import start_method_for
    from ..launching.launcher import launch
    from ..models import worker_modules
    from ..run.prepare import prepare
    from ..run.worker import WorkerArgs, run_training

    options = (profile or ProfileOptions()).replace(first=first, stop=stop, trace_out=trace_out,
                                                    cpus_per_rank=cpus_per_rank).validate()
    options.check(config.optimizer.steps)
    prepared = prepare(config, world_size=config.world_size)     # once, before the workers
    results = launch(run_training, config.world_size,
                     (WorkerArgs(config, progress=False, profile=options, prepared=prepared),),
                     timeout=timeout, cpus_per_rank=cpus_per_rank,
                     start_method=start_method_for(config.runtime.device, config.runtime.backend),
                     preload=worker_modules(config))
    run = results[0].measured
    if run is None:
        raise RuntimeError("rank 0 returned no measured run (was the profiled range empty?)")
    return run


def compare_parser() -> argparse.ArgumentParser:

    p = GivenFlagsParser(
        prog="pipeexec compare", add_help=False, formatter_class=DefaultsHelpFormatter,
        description="Run a schedule for real with profiling, simulate it with costs calibrated "
                    "from that run (or from --alongside steps, or a --calibrate-from run), and "
                    "compare. Every model and layout flag of `pipeexec train` applies "
                    "(--schedule, --pp, --vpp, --microbatches, --layers, --hidden, ...), with "
                    f"compare's own defaults where a flag is not given: --steps {DEFAULT_STEPS} "
                    "(steps 1.. profiled), --microbatches 2*pp (at least the calibration run's), "
                    "and, without --calibrate-from, the model of benchmarks/bench_prediction.py "
                    "(--layers 6, more for more stages, --hidden 256 --heads 4 --seq-len 128 "
                    "--micro-batch-size 4). With --calibrate-from, the model, precision and "
                    "CPU share (--cpus-per-rank) are the calibration run's.")
    a = p.add_argument
    a("-h", "--help", action="store_true", help="show this help and the train flags")
    a("--profile", default=None, metavar="A:B",
      help="steps to profile (default: 1:STEPS, skipping the warm-up step)")
    a("--calibrate-from", default=None, metavar="RUN_TRACE",
      help="calibrate from this measured run (its .json, .csv or .meta.json) instead of the "
           "run itself: a prediction made without this run's timings. Its model and CPU share "
           "are taken; a flag setting another value is refused, naming each field")
    a("--alongside", default=None, metavar="NAME[:VPP]",
      help="train this schedule (e.g. 1f1b) in the same job, alternating steps with the "
           "compared one, and predict the compared schedule from its steps alone: calibration "
           "and measurement meet the same machine seconds apart (not with --calibrate-from)")
    a("--hardware", default=None, metavar="PRESET|FILE",
      help="without --calibrate-from: predict the run from this hardware file (or preset) "
           "alone before it starts, as the run is confined (--cpus-per-rank, or the ranks "
           "sharing the cores), and print it beside the measured step; "
           "with --calibrate-from a run at another tp (or sequence parallelism), cp or ep: "
           "carry its measured compute to this run's layout by the plan's per-operator model "
           "on this hardware, and price the layers' collectives (tp's, cp's K/V all-gathers "
           "and reduce-scatters, ep's all-to-alls) from its figures (on this machine: the "
           "file `pipeexec calibrate-hardware` writes, whose collectives are measured)")
    a("--trace-out", default=None, metavar="FILE.json",
      help="keep the measured trace: Chrome/Perfetto JSON, with .csv and .meta.json beside it")
    a("--report-out", default=None, metavar="FILE.json",
      help="write the report as JSON, and (unless --plot-out names another file) the "
           "predicted-above-measured picture beside it as FILE.png")
    a("--table-out", default=None, metavar="FILE.csv|FILE.md",
      help="write the table as CSV, or as markdown for a .md name. The CSV's first column, "
           "row, says which table a row is from: 'rank' (a rank, or 'all': the printed "
           "table's rows, seconds and bytes) and, for a ZeRO-2/3 run, 'sharding' (ZeRO's "
           "actions: one row per action and stage, count / per_action / per_step measured, "
           "predicted and error; columns action and stage); a row leaves the other kind's "
           "columns empty")
    a("--plot-out", default=None, metavar="FILE.png",
      help="predicted and measured Gantt charts on one time axis (default: beside "
           "--report-out, as .png)")
    # the layout, batch and model flags: pipesim's one table, as train's (its base plan)

    add_plan_flags(p, defaults=_shown_defaults())
    return p


def compare_defaults(config: Any, given: set[str], calibration: MeasuredRun | None = None
                     ) -> tuple[Any, list[str]]:
    """``config`` with compare's defaults for what the user did not set: m = 2 pp (at least
    the calibration run's m), `DEFAULT_STEPS` steps, and without a calibration run the model of
    ``benchmarks/bench_prediction.py`` (`DEFAULT_MODEL`, with a block per stage at least: train's
    tiny default model runs actions of a millisecond, where per-action overheads and CPU-quota
    periods dominate). Returns the config and what was defaulted, in words."""
    changes: dict[str, Any] = {}
    if "microbatches" not in given:
        pp = config.plan.parallelism.pp
        m = max(2 * pp, calibration.plan.microbatches if calibration else 0)
        changes["microbatches"] = m
    if calibration is None:
        for name, value in DEFAULT_MODEL.items():
            if name not in given:
                changes[name] = value
        if "layers" not in given:
            changes["layers"] = max(DEFAULT_MODEL["layers"], config.num_stages - 2)
    if "steps" not in given:
        changes["steps"] = DEFAULT_STEPS
    flat = config.to_flat()
    changes = {k: v for k, v in changes.items() if flat[k] != v}
    said = [f"{k.replace('_', '-')} {v}" for k, v in changes.items()]
    return config.with_flat(**changes), said


def layout_notes(config: Any, profiled: int) -> list[str]:
    """What makes this run's comparison weak, said before it runs: few microbatches for the
    pipeline's depth (a step that is mostly ramp-up and ramp-down; no pipeline at pp 1), and
    few profiled steps."""
    notes = []
    pp, m = config.plan.parallelism.pp, config.plan.microbatches
    if pp > 1 and m < 2 * pp:
        notes.append(f"m = {m} < 2 pp = {2 * pp}: a step is mostly ramp-up and ramp-down")
    if profiled < 3:
        notes.append(f"{profiled} profiled step(s): single steps move by 10% and more on "
                     f"a shared machine; --steps {DEFAULT_STEPS} (the default) profiles "
                     f"{DEFAULT_STEPS - 1} and compares the central 3")
    return notes


def calibration_spread_note(source: MeasuredRun, threshold: float = 0.10) -> list[str]:
    """A note when the calibration run's profiled steps moved more than ``threshold`` (of
    their median): a separate job on a busy machine, whose drift the prediction carries."""
    spans = sorted(source.makespans().values())
    if len(spans) < 2:
        return []
    median = spans[(len(spans) - 1) // 2]
    spread = (spans[-1] - spans[0]) / median if median > 0 else 0.0
    if spread <= threshold:
        return []
    return [f"the calibration run's profiled steps took {spans[0] * 1e3:.0f}-"
            f"{spans[-1] * 1e3:.0f} ms ({spread:.0%} of their median): the machine was busy "
            "then, and a prediction from another job carries that drift; --alongside 1f1b "
            "calibrates in the same job"]


def alongside_config(config: Any, text: str) -> Any:
    """The calibration config of ``--alongside NAME[:VPP]``: ``config`` with that schedule."""
    name, _, vpp = text.partition(":")
    try:
        v = int(vpp) if vpp else 1
    except ValueError:
        raise ValueError(f"--alongside {text!r}: expected NAME or NAME:VPP (e.g. 1f1b, "
                         "interleaved:2)") from None
    partner = config.with_flat(schedule=name, vpp=v)
    partner.validate(world_size=partner.world_size)
    return partner


def compare_main(argv: list[str]) -> int:
    """``pipeexec compare ...``; returns the exit status (2: bad arguments, 1: run failed)."""
    from ..launching.cpu_quota import QuotaUnavailable
    from ..launching.launcher import WorkerFailed
    from ..run.preflight import check_cpus_per_rank, check_timeout
    from ..measuring.session import parse_step_range

    ns, rest = compare_parser().parse_known_args(argv)
    parser = train_parser(prog="pipeexec compare", monitor=False)
    if ns.help:
        compare_parser().print_help()
        print("\ntrain flags (pipeexec train --help):")
        parser.print_help()
        return 0
    try:
        tns = parser.parse_args(rest)
        for dest in DESTS:                  # the table's flags, parsed by compare's parser
            setattr(tns, dest, getattr(ns, dest))
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        # the flags given: train's, and the table's (parsed by compare's parser)
        given = set(tns.given) | (set(ns.given) & set(DESTS))
        tns.given = frozenset(given)
        config = config_from_args(tns)
        if tns.plan:                 # the plan's fields are set, as flags are
            given |= set(PLAN_DESTS)
        if config.inputs.hf_model or "model" in given:   # and so are a named model's
            given |= set(HF_FIELDS) | ({"seq_len"} if "model" in given else set())
        if "global_batch_size" in given:          # the microbatches it makes
            given.add("microbatches")
        cpus_per_rank = tns.cpus_per_rank
        source = MeasuredRun.load(ns.calibrate_from) if ns.calibrate_from else None
        notes: list[str] = []
        share_taken = False
        if source is not None:
            inherited = inherit(config, given, source.meta, cpus_per_rank=cpus_per_rank,
                                source=ns.calibrate_from)
            config, cpus_per_rank = inherited.config, inherited.cpus_per_rank
            share_taken = "cpus_per_rank" in inherited.taken
            notes += inherited.notes
            notes += calibration_spread_note(source)
            if inherited.taken:
                print(f"from the calibration run {ns.calibrate_from}: {inherited.describe()}",
                      flush=True)
        config, defaulted = compare_defaults(config, given, source)
        if ns.profile is not None and "steps" not in given:
            config = config.with_flat(steps=parse_step_range(ns.profile)[1])
            defaulted = [d for d in defaulted if not d.startswith("steps")]
        if defaulted:
            print(f"compare defaults: {', '.join(defaulted)} (set them to change)", flush=True)
        first, stop = parse_step_range(ns.profile) if ns.profile else (1, config.optimizer.steps)
        notes += layout_notes(config, stop - first)
        check_cpus_per_rank(cpus_per_rank, config.world_size)
        check_timeout(getattr(tns, "timeout", None))
        # train's generated profiling flags (clock alignment, split probe); the steps and the
        # trace file are compare's own --profile and --trace-out
        profile = ProfileOptions(**{k: v for k, v in values_from_args(ProfileOptions, tns).items()
                                    if k not in ("first", "stop", "trace_out")})
        try:
            config.validate(world_size=config.world_size)
        except ConfigError as exc:
            if source is not None and "layers" not in given and "stages" in str(exc):
                raise ConfigError(f"{exc} (the calibration run's model has --layers "
                                  f"{config.plan.model.layers}; calibrate from a run with more "
                                  "layers)") from None
            if tns.plan:
                raise ConfigError(f"--plan {tns.plan}: {exc}") from None
            raise
        partner = None
        if ns.alongside:
            if source is not None:
                raise ValueError("give --calibrate-from (a run made before) or --alongside (a "
                                 "calibration run in the same job), not both")
            partner = alongside_config(config, ns.alongside)
        carry, from_hw = None, None
        if source is not None:
            carry = layout_carry(config, source, ns.hardware, ns.calibrate_from)
        elif ns.hardware:
            from ..analysis.from_hardware import hardware_prediction
            from ..launching.cpu_quota import cpu_limit

            from_hw = hardware_prediction(config, ns.hardware, cpus_per_rank=cpus_per_rank,
                                          host_cpus=cpu_limit())
            print(f"prediction before running, {from_hw.describe()}: "
                  f"{from_hw.makespan * 1e3:.1f} ms, bubble_fraction "
                  f"{from_hw.result.bubble_fraction:.3f}", flush=True)
        if source is not None:
            layout = layout_of(config)
            predicted, cal = predict(program_of(config), layout, source, carry=carry)
            print(f"prediction before running, calibrated from {ns.calibrate_from}: "
                  f"{predicted.makespan * 1e3:.1f} ms, bubble_fraction "
                  f"{predicted.bubble_fraction:.3f}", flush=True)
        if partner is not None:
            from ..run.paired import paired_runs

            source, run = paired_runs([partner, config], first, stop,
                                      trace_outs=[None, ns.trace_out],
                                      timeout=getattr(tns, "timeout", None),
                                      cpus_per_rank=cpus_per_rank, profile=profile)
            print(f"predicted from the {partner.plan.schedule_name} steps of the same job "
                  f"(alternating with the {config.plan.schedule_name} steps)", flush=True)
        else:
            run = profiled_run(config, first, stop, trace_out=ns.trace_out,
                               timeout=getattr(tns, "timeout", None),
                               cpus_per_rank=cpus_per_rank, profile=profile)
        comparison = compare_runs(run, source, carry=carry)
    except KeyboardInterrupt as exc:     # Ctrl-C, or the launcher's Stopped (SIGTERM, SIGHUP)
        workers = tns.tp * tns.cp * tns.pp * tns.dp
        how = f"stopped by {exc.signal_name}" if hasattr(exc, "signal_name") else "interrupted"
        print(f"\npipeexec compare: {how}: stopped {workers} workers",
              file=sys.stderr, flush=True)
        return getattr(exc, "exit_status", 130)
    except WorkerFailed as exc:
        print(f"pipeexec compare: error: {exc}", file=sys.stderr)
        return 1
    except QuotaUnavailable as exc:
        why = (f"the calibration run's ranks were confined to --cpus-per-rank {cpus_per_rank:g}, "
               f"which this machine cannot do ({exc}); calibrate from a run made without "
               "--cpus-per-rank" if share_taken else str(exc))
        print(f"pipeexec compare: error: {why}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, pipesim.ScheduleError) as exc:
        print(f"pipeexec compare: error: {exc}", file=sys.stderr)
        return 2
    print(comparison.text())
    extra, line = plan_memory(config, comparison.report()["measured_peak_memory"])
    print(line)
    if from_hw is not None:
        measured = comparison.report()["measured_step_time"]
        extra["hardware_prediction"] = {
            "hardware": from_hw.hardware, "cpus_per_rank": from_hw.share,
            "shared_cores": from_hw.cores, "predicted_step_time": from_hw.makespan,
            "measured_step_time": measured,
            "step_time_error": (from_hw.makespan - measured) / measured}
        print(f"{from_hw.describe()}: predicted {from_hw.makespan * 1e3:.1f} ms before running, "
              f"measured {measured * 1e3:.1f} ms "
              f"({(from_hw.makespan - measured) / measured:+.1%}); the table above predicts "
              "from the run's own trace")
    if carry is not None and carry.note:
        notes.insert(0, carry.note)
        if carry.coupled and cpus_per_rank is not None:
            notes.insert(1, COUPLED_NOTE)
    for note in notes:
        print(f"note: {note}")
    write_outputs(comparison, report_out=ns.report_out, table_out=ns.table_out,
                  plot_out=ns.plot_out, trace_out=ns.trace_out, extra=extra)
    return 0


def layout_carry(config: Any, source: MeasuredRun, hardware: str | None, path: str
                 ) -> "LayoutCarry | None":
    """A `LayoutCarry` when the calibration run's tp, sequence parallelism, cp or ep differs
    from ``config``'s (`pipeexec.analysis.tensor_parallel`); None when they agree."""
    from pipesim.hardware import get_hardware

    from ..config import TrainConfig

    theirs = TrainConfig.from_dict(source.meta["config"])
    def sizes(c: TrainConfig) -> dict[str, Any]:
        par = c.plan.parallelism
        return {"tp": par.tp, "sequence_parallel": bool(par.sequence_parallel), "cp": par.cp,
                "ep": par.ep}

    src, tgt = sizes(theirs), sizes(config)
    if src == tgt:
        return None
    if hardware is None:
        def said(d: dict) -> str:
            words = [f"tp {d['tp']}"] + (["with sequence parallelism"] if d["sequence_parallel"]
                                         else [])
            words += [f"{k} {d[k]}" for k in ("cp", "ep") if d[k] > 1]
            return " ".join(words)
        raise ValueError(f"--calibrate-from {path} ran at {said(src)}, this run at {said(tgt)}: "
                         "give --hardware FILE (`pipeexec calibrate-hardware --out FILE` on this "
                         "machine) to carry the costs and price the layers' collectives")
    # the source: this run's model and stages at the calibration run's sizes (its dp: ep is
    # carved out of dp x cp)
    source_config = config.with_flat(dp=theirs.plan.parallelism.dp, **src)
    return LayoutCarry(source_config.plan_as_run(), config.plan_as_run(), get_hardware(hardware))


# What a carried cp / ep prediction cannot hold on a CPU-quota run (docs/executor.md, measured
# with benchmarks/bench_cp_ep_compare.py)
COUPLED_NOTE = ("cp's and ep's collectives run inside the layers, each making a rank wait for its "
                "partners; under --cpus-per-rank a partner is often throttled by its quota, a "
                "wait the collective benchmark (no compute around it) never sees: on the "
                "development VM such predictions ran 4-56% low")


class LayoutCarry:
    """Calibrated costs carried from the calibration run's tp / cp / ep to the run's, both
    priced as pipeexec runs them (``note``: what was done, once it was)."""

    def __init__(self, source_plan: Any, target_plan: Any, hardware: Any) -> None:
        from ..analysis.tensor_parallel import as_executed
        self.source_plan, self.target_plan = as_executed(source_plan), as_executed(target_plan)
        self.hardware = hardware
        self.note: str | None = None
        par = self.target_plan.parallelism
        self.coupled = par.cp > 1 or par.ep > 1      # collectives inside the layers' F and B

    def __call__(self, cal: Any) -> Any:
        from dataclasses import replace

        from ..analysis.tensor_parallel import carry_to_layout, layout_name, layout_note
        src, tgt = self.source_plan.parallelism, self.target_plan.parallelism
        costs, summary = carry_to_layout(cal.costs, self.source_plan, self.target_plan,
                                         self.hardware)
        self.note = layout_note(src, tgt, self.hardware.name, summary)
        carried = {"tp": src.tp, "carried_from": layout_name(src), "carried_to": layout_name(tgt),
                   "hardware": self.hardware.name, "collectives": summary["collectives"]}
        if src.tp != tgt.tp:
            carried["carried_to_tp"] = tgt.tp
        return replace(cal, costs=costs, source={**cal.source, **carried})


def plan_memory(config: Any, measured: list[float]) -> tuple[dict[str, Any], str]:
    """The activation peaks pipesim predicts for ``config``'s plan from the model's shape alone
    (`pipeexec.analysis.plan_memory`), against the ``measured`` peaks per rank: report fields
    and a line to print (saying why, when the config has no plan)."""

    try:
        predicted = predicted_activation_peaks(config)
    except (ConfigError, pipesim.PlanError, ValueError) as exc:
        return {}, f"no activation memory predicted from the plan: {exc}"

    errors = [(p - m) / m if m else None for p, m in zip(predicted, measured)]
    scale, unit = byte_unit(max(predicted + list(measured)))
    per_rank = ", ".join(
        f"rank {r} {p / scale:.2f} {unit} (measured {m / scale:.2f}"
        + (f", {e:+.1%})" if e is not None else ")")
        for r, (p, m, e) in enumerate(zip(predicted, measured, errors)))
    return ({"plan_predicted_peak_memory": predicted, "plan_peak_memory_error": errors},
            f"peak activation memory predicted from the plan alone (model shape, recompute "
            f"{config.plan.parallelism.recompute}; no calibration): {per_rank}")


def write_outputs(comparison: Comparison, *, report_out: str | None = None,
                  table_out: str | None = None, plot_out: str | None = None,
                  trace_out: str | None = None, extra: dict[str, Any] | None = None
                  ) -> dict[str, str]:
    """Write the report JSON (with ``extra``'s fields), table (CSV: `Comparison.csv_table`,
    the rank rows and ZeRO's; markdown for a .md name) and picture; return their paths."""
    files: dict[str, str] = {}
    if plot_out is None and report_out is not None:
        plot_out = str(Path(report_out).with_suffix(".png"))
    if table_out:
        Path(table_out).parent.mkdir(parents=True, exist_ok=True)
        if table_out.endswith(".md"):
            Path(table_out).write_text(comparison.headline() + "\n\n" + comparison.markdown() + "\n")
        else:
            comparison.csv_table().to_csv(table_out, index=False)
        files["table"] = table_out
    if plot_out:
        Path(plot_out).parent.mkdir(parents=True, exist_ok=True)
        comparison.figure().savefig(plot_out, dpi=110)
        files["plot"] = plot_out
    if trace_out:
        chrome, csv, meta = MeasuredRun.paths(trace_out)
        files.update(trace=str(chrome), trace_csv=str(csv), trace_meta=str(meta))
    if report_out:
        report = comparison.report()
        report.update(extra or {})
        report["files"] = dict(files)
        path = Path(report_out)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        tmp.replace(path)
        files["report"] = report_out
    for kind, path in files.items():
        print(f"wrote {kind}: {path}")
    return files
