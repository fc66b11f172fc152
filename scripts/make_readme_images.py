"""Write the README's Gantt charts to docs/img/ (simulated, uniform stages).

    python3 scripts/make_readme_images.py [--out docs/img] [--pp 4] [--microbatches 8]

* ``gantt_<schedule>.png`` for 1f1b, interleaved (vpp=2), zb-h1 and zbv (vpp=2): one step on
  uniform stages (F = 1, B = 2 split as I = W = 1 time units per microbatch per rank, each of
  a rank's v chunks a v-th of that), with the activations every rank holds under it, counted
  in microbatches;
* ``schedules.png``: every schedule of ``pipesim.schedule_names()`` on one time axis.

These are simulated by pipesim (no torch needed); the script prints each chart's makespan
and both bubble metrics, which the README quotes. With ``--measured`` (needs torch) it also
writes ``predicted_vs_measured.png``: a 1F1B run on 2 CPU ranks is profiled, interleaved 1F1B
(vpp=2) is predicted from it, then run and measured (``pipeexec compare --calibrate-from``),
and the two Gantt charts are drawn on one time axis.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pipesim
from pipesim import CostModel

ROOT = Path(__file__).resolve().parent.parent
VPP = {"gpipe": 1, "1f1b": 1, "looped-bfs": 2, "interleaved": 2, "zb-h1": 1, "zb-h2": 1, "zbv": 2}
SINGLE = ("1f1b", "interleaved", "zb-h1", "zbv")


def simulate(name: str, pp: int, m: int):
    v = 2 if pipesim.schedule_info(name).placement == "v" else VPP.get(name, 1)
    try:
        schedule = pipesim.build_schedule(name, pp=pp, microbatches=m, vpp=v)
    except pipesim.ScheduleError:       # dualpipe: one model part per rank (and its copy)
        schedule = pipesim.build_schedule(name, pp=pp, microbatches=m, vpp=1)
    # One "microbatch of activations" per rank per microbatch: each model part a rank holds
    # computes and keeps 1/parts of it.
    v = schedule.parts_per_rank
    costs = CostModel.uniform(1.0 / v, 2.0 / v, activation_bytes=1.0 / v)
    return pipesim.simulate(schedule, costs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--microbatches", "-m", type=int, default=8)
    p.add_argument("--dpi", type=int, default=110)
    p.add_argument("--measured", action="store_true",
                   help="also profile real CPU runs for predicted_vs_measured.png (needs torch)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    pp, m = args.pp, args.microbatches

    print(f"simulated, uniform stages (F=1, I=W=1 per rank per microbatch), pp={pp}, m={m}")
    print(f"{'schedule':12} {'vpp':>3} {'makespan':>9} {'bubble_fraction':>16} {'bubble_rate':>12} "
          f"{'peak held':>9}")
    results = {}
    for name in pipesim.schedule_names():
        r = results[name] = simulate(name, pp, m)
        print(f"{name:12} {r.schedule.vpp:>3} {r.makespan:>9.4g} {r.bubble_fraction:>16.4f} "
              f"{r.bubble_rate:>12.4f} {max(r.peak_memory):>9.3g}")

    for name in SINGLE:
        r = results[name]
        v = r.schedule.vpp
        title = (f"{name}: pp={pp}" + (f" vpp={v}" if v > 1 else "") + f" m={m}, uniform stages "
                 f"(simulated): bubble_fraction {r.bubble_fraction:.3f}, bubble_rate {r.bubble_rate:.3f}")
        fig = r.gantt(memory=True, title=title, figsize=(11, 3.6), unitless=True)
        fig.axes[0].set_xlabel("")
        fig.axes[1].set_ylabel("activations held\n(microbatches)", fontsize=8)
        fig.axes[1].set_xlabel("time (units of one forward)")
        path = args.out / f"gantt_{name}.png"
        fig.savefig(path, dpi=args.dpi)
        print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    span = max(r.makespan for r in results.values())
    fig = Figure(figsize=(11, 1.2 * len(results) + 0.4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(results), 1, sharex=True)
    for ax, (name, r) in zip(axes, results.items()):
        s = r.schedule
        layout = (" (vpp=1, a rank holding a part and a copy of another)" if s.has_copies else
                  f" (vpp={s.vpp})" if s.vpp > 1 else "")
        r.gantt(ax=ax, xlim=(0, span), labels=True, unitless=True,
                title=f"{name}{layout}" +
                      f": makespan {r.makespan:.4g}, bubble_fraction {r.bubble_fraction:.3f}, "
                      f"peak {max(r.peak_memory):.3g} microbatches held")
        ax.set_xlabel("")
    axes[-1].set_xlabel(f"time (units of one forward), pp={pp}, m={m}, uniform stages, simulated")
    path = args.out / "schedules.png"
    fig.savefig(path, dpi=args.dpi)
    print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    if args.measured:
        predicted_vs_measured(args.out / "predicted_vs_measured.png", args.dpi)
    return 0


def predicted_vs_measured(path: Path, dpi: int) -> None:
    """Train 1f1b and interleaved (pp=2, vpp=2) in one job, alternating steps (the prediction
    benchmark's method), predict interleaved from the 1f1b steps alone, draw both."""
    from pipeexec.config import TrainConfig
    from pipeexec.analysis.compare import compare_runs
    from pipeexec.run.paired import paired_runs

    # The prediction benchmark's model (benchmarks/bench_prediction.py): at a smaller width the
    # actions last a millisecond or two and per-action overheads the costs do not carry dominate.
    model = TrainConfig.from_flat(pp=2, microbatches=8, layers=6, hidden=256, heads=4,
                                  seq_len=128, vocab=256, micro_batch_size=4, steps=6,
                                  backend="gloo", device="cpu")
    calib, run = paired_runs([model.with_flat(schedule="1f1b"),
                              model.with_flat(schedule="interleaved", vpp=2)], 1, model.steps)
    comparison = compare_runs(run, calib)
    print(comparison.headline())
    fig = comparison.figure()
    head, _, _ = comparison.headline().partition("; calibrated")
    fig.suptitle(f"{head}\npredicted from the 1f1b steps of the same job (pp=2 vpp=1, "
                 "alternating steps); measured on 2 CPU ranks (gloo)", fontsize=10)
    fig.savefig(path, dpi=dpi)
    print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")


if __name__ == "__main__":
    sys.exit(main())
