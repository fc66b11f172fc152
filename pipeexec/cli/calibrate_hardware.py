"""``pipeexec calibrate-hardware``: measure this machine's figures for pipesim's time model
(`pipeexec.measuring.calibrate_hardware`) and write them as a hardware file (``--hardware
FILE``); bad flags exit with 2, a failed collective benchmark with 1."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from pipesim.hardware import COLLECTIVE_NAMES

from ..measuring.calibrate_hardware import busy_note, calibrate

def add_command(sub) -> None:
    from pipesim.cli.help import DefaultsHelpFormatter

    p = sub.add_parser("calibrate-hardware", help="measure this machine's figures for pipesim's "
                       "time model and write a hardware file (--hardware FILE)",
                       formatter_class=DefaultsHelpFormatter)
    p.add_argument("--out", required=True, metavar="FILE.json", help="the hardware file to write")
    p.add_argument("--device", default="cpu", help="cpu, or a CUDA device (cuda:0)")
    p.add_argument("--name", default=None, help="the hardware's name in the file")
    p.add_argument("--no-links", action="store_true",
                   help="skip the gloo collective benchmark (links: assumed figures, none per "
                        "collective)")
    p.add_argument("--collective-groups", default=None, metavar="P,P",
                   help="the benchmark's group sizes (ranks) (default: 2,4; 2 with --quick)")
    p.add_argument("--collective-sizes", default=None, metavar="SIZE,SIZE",
                   help="the benchmark's message sizes, with units (default: 4KiB to 25MiB; "
                        "4KiB,256KiB,4MiB with --quick)")
    p.add_argument("--collective-repeats", type=int, default=None, metavar="N",
                   help="timed repeats per point, the median kept (default: 9; 3 with --quick)")
    p.add_argument("--base", default=None, metavar="PRESET",
                   help="on a CUDA device: the preset (or hardware file) whose datasheet peaks, "
                        "HBM bandwidth and links the measured efficiencies are stated against "
                        "(default: the preset the device's name names)")
    p.add_argument("--threads", type=int, default=1, metavar="N",
                   help="torch threads on a CPU: 1 measures a core as a pipeexec rank uses it "
                        "(each rank runs one thread); more measures what N threads reach")
    p.add_argument("--quick", action="store_true", help="a smaller sweep (tests)")


def _list(text: str | None, parse, flag: str) -> tuple | None:
    if text is None:
        return None
    try:
        out = tuple(parse(x) for x in text.replace(" ", ",").split(",") if x)
    except ValueError as exc:
        raise ValueError(f"{flag} {text!r}: {exc}") from None
    if not out:
        raise ValueError(f"{flag} {text!r}: no value given")
    return out


def run(ns: argparse.Namespace) -> int:
    import torch

    if ns.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"calibrate-hardware: --device {ns.device}: no CUDA device here; use --device cpu")
        return 2
    from pipesim.units import parse_bytes

    from ..measuring.collectives import CollectiveBenchmarkError

    try:
        groups = _list(ns.collective_groups, int, "--collective-groups")
        sizes = _list(ns.collective_sizes, lambda x: int(parse_bytes(x)), "--collective-sizes")
        if groups and min(groups) < 2:
            raise ValueError(f"--collective-groups {ns.collective_groups!r}: a group has 2 ranks "
                             "at least")
        if ns.collective_repeats is not None and ns.collective_repeats < 1:
            raise ValueError(f"--collective-repeats {ns.collective_repeats}: must be >= 1")
        if sizes and len(set(sizes)) < 2:
            raise ValueError(f"--collective-sizes {ns.collective_sizes!r}: a fit needs two "
                             "sizes at least")
    except ValueError as exc:
        print(f"calibrate-hardware: {exc}")
        return 2
    if ns.threads < 1:
        print(f"calibrate-hardware: --threads {ns.threads}: must be >= 1")
        return 2
    busy = busy_note(os.getloadavg()[0], os.cpu_count() or 1)
    if busy and not ns.device.startswith("cuda"):
        print(f"calibrate-hardware: warning: {busy}", flush=True)
    if ns.base is not None and not ns.device.startswith("cuda"):
        print(f"calibrate-hardware: --base {ns.base}: only for a CUDA device (a CPU's figures "
              "are its own)")
        return 2
    try:
        hw = calibrate(ns.device, ns.name, links=not ns.no_links, quick=ns.quick, groups=groups,
                       sizes=sizes, repeats=ns.collective_repeats, base=ns.base,
                       threads=ns.threads)
    except CollectiveBenchmarkError as exc:
        print(f"calibrate-hardware: {exc}")
        return 1
    except ValueError as exc:
        print(f"calibrate-hardware: {exc}")
        return 2
    hw.save(Path(ns.out))
    print(f"{hw.name}: peak {hw.peak_flops / 1e9:.1f} GFLOP/s, GEMM eff = {hw.gemm_e_max:.3f} / "
          f"(1 + {hw.gemm_dim_half:.1f} (1/m + 1/n + 1/k)), element-wise {hw.hbm_bandwidth / 1e9:.1f} "
          f"GB/s, launch {hw.launch_overhead * 1e6:.1f} us, attention {hw.flash_e_max:.3f}, "
          f"link {hw.link_bandwidth / 1e9:.2f} GB/s + {hw.link_latency * 1e6:.0f} us -> {ns.out}")
    if hw.collectives:
        print("collectives over gloo, per ring step and bandwidth (pipesim.plan.collectives' "
              "convention):")
    for name, p, lat, bw in sorted(hw.collective_figures("intra"),
                                   key=lambda r: (COLLECTIVE_NAMES.index(r[0]), r[1])):
        print(f"  {name:<15} p={p}: {lat * 1e6:8.1f} us, {bw / 1e9:.3f} GB/s")
    return 0
