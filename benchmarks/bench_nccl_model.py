"""pipesim's collective model on the GPU presets beside NCCL's published nccl-tests bus bandwidths.

For representative groups (8 GPUs of an HGX H100 node; 16 on two DGX A100s, 8 NICs each; a
GB200 NVL72 rack) and message sizes, prints the algorithm and protocol NCCL's tuner picks
(:mod:`pipesim.plan.nccl`), the time, nccl-tests' bus bandwidth of that time (all-reduce
``2 (p - 1) / p * n / t``, all-gather ``(p - 1) / p * n / t``) and, where one is published, the
measured figure and its source:

* 8 x H100, all-reduce with NVLink SHARP ~480 GB/s peak; the ring (``NCCL_ALGO=RING``) and the
  operations other than all-reduce ~370 GB/s: NCCL's maintainer, NVIDIA/nccl-tests#212
  (2024-05-06);
* 2 x DGX A100 (8 x 200 Gbit/s NICs a node), all-reduce 192 GB/s: NVIDIA, NVIDIA/nccl#812
  (quoted in NVIDIA/nccl#1576);
* a GB200 NVL72 rack, 72 GPUs, all-reduce 586 / 681 / 758 / 839 / 835 GB/s at 512 MiB to
  8 GiB (out of place): coreweave/nccl-tests#43 (2025-02-20).

    python3 benchmarks/bench_nccl_model.py

Pure arithmetic (no GPU, no timing): the figures are the model's, the published ones copied.
"""
from __future__ import annotations

import statistics
import sys

from pipesim.hardware import get_hardware
from pipesim.plan import collectives as coll
from pipesim.plan.cluster import Cluster
from pipesim.plan.parallelism import Parallelism
from pipesim.units import GiB, MiB, format_bytes

SIZES = (4 << 10, 64 << 10, 1 * MiB, 16 * MiB, 256 * MiB, 8 * GiB)
_212 = "NVIDIA/nccl-tests#212"
_812 = "NVIDIA/nccl#812"
_43 = "coreweave/nccl-tests#43"


def _link(hw: str, par: Parallelism, group: str, nvls: bool = True):
    link = Cluster(get_hardware(hw)).group_links(par)[group]
    if not nvls:
        from dataclasses import replace
        link = replace(link, nvls=False)
    return link


# (label, hardware, layout, group, ranks, collective, NVLS allowed, {size: (published, source)})
CASES = (
    ("8 x H100 (one node)", "H100", Parallelism(tp=8), "tp", 8, "all_reduce", True,
     {8 * GiB: (480e9, _212)}),
    ("8 x H100, NCCL_ALGO=RING", "H100", Parallelism(tp=8), "tp", 8, "all_reduce", False,
     {8 * GiB: (370e9, _212)}),
    ("8 x H100 (one node)", "H100", Parallelism(tp=8), "tp", 8, "all_gather", True,
     {8 * GiB: (370e9, _212)}),
    ("16 x A100 (2 DGX, 8 NICs)", "A100", Parallelism(dp=16), "dp", 16, "all_reduce", True,
     {8 * GiB: (192e9, _812)}),
    ("16 x H100, tp 8 (1 NIC a rank)", "H100", Parallelism(tp=8, dp=2), "dp", 2, "all_reduce",
     True, {}),
    ("72 x GB200 (one NVL72 rack)", "GB200", Parallelism(tp=72), "tp", 72, "all_reduce", True,
     {512 * MiB: (586.06e9, _43), 1 * GiB: (681.17e9, _43), 2 * GiB: (757.78e9, _43),
      4 * GiB: (839.16e9, _43), 8 * GiB: (834.57e9, _43)}),
)


def busbw(name: str, n: float, p: int, t: float) -> float:
    return (2 * (p - 1) / p if name == "all_reduce" else (p - 1) / p) * n / t


def main() -> int:
    print(f"{'group':<32} {'collective':<11} {'size':>9} {'algorithm':>16} {'time us':>10} "
          f"{'busbw GB/s':>10} {'published':>9} {'ratio':>6}  source")
    ratios = []
    for label, hw, par, group, p, name, nvls, published in CASES:
        link = _link(hw, par, group, nvls)
        for n in sorted(set(SIZES) | set(published)):
            c = coll.nccl_choice(name, n, p, link)
            bw = busbw(name, n, p, c.seconds)
            pub, src = published.get(n, (None, ""))
            ratio = bw / pub if pub else None
            if ratio:
                ratios.append(ratio)
            print(f"{label:<32} {name:<11} {format_bytes(n):>9} "
                  f"{c.algorithm + '/' + c.protocol:>16} {c.seconds * 1e6:>10.1f} "
                  f"{bw / 1e9:>10.1f} {'' if pub is None else f'{pub / 1e9:.0f}':>9} "
                  f"{'' if ratio is None else f'{ratio:.3f}':>6}  {src}")
    err = [abs(r - 1) for r in ratios]
    print(f"summary: {len(ratios)} published points, model / published median "
          f"{statistics.median(ratios):.3f}, worst error {max(err):.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
