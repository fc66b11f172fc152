"""``pipeexec calibrate-hardware``: measure this machine's figures for pipesim's time model.

Why: pipesim's per-operator model (:mod:`pipesim.plan.operators`) reads a GEMM-efficiency
curve by shape, the bandwidth element-wise kernels reach, attention's efficiency, a per-kernel
overhead and the links; a preset carries them from datasheets and fits, a hardware file from
this machine. Measured here with torch, on the device given (CPU, or one CUDA GPU):

* GEMM sweep: ``torch.matmul`` over a grid of (m, n, k), the best of timed repeats; the peak is
  the best rate seen, each shape's efficiency its rate over that peak (the table), and the
  curve ``e_max / (1 + d (1/m + 1/n + 1/k))`` fitted to it (least median error: robust to the
  samples a busy machine slowed);
* element-wise bandwidth: ``torch.add(x, y, out=z)`` (12 bytes an element in fp32) on tensors
  the size of a small model's activations (4 MiB) and on a large one; the former is stored (on
  a CPU it is what a pipeline's tensors see, in cache), the latter noted in the sources;
* the per-kernel overhead: a one-element add with autograd, forward and backward;
* attention: ``scaled_dot_product_attention`` forward + backward at one shape, as the
  ``flash_e_max`` the model's sequence and head-dim factors scale;
* collectives: all-reduce over gloo between 2 processes on this host at several sizes, fitted
  as latency + bytes / bandwidth (the ring's ``2 (p-1)/p`` bytes), for both links.

The file is :meth:`pipesim.hardware.Hardware.to_dict`'s JSON with ``calibration: measured``,
each figure's method in ``sources``; ``--hardware FILE`` reads it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from pipesim.hardware import Hardware

SIZES = (64, 128, 256, 512, 1024)


def _timed(fn, sync, repeat: int) -> float:
    fn()
    sync()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    return min(samples)          # the best of the repeats: other load only slows a sample


def gemm_sweep(device: str, dtype, repeat: int = 5, sizes=SIZES) -> list[tuple[int, int, int, float]]:
    """(m, n, k, FLOP/s) for every shape of the grid (cubes and the thin ones a layer has)."""
    import torch

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    shapes = {(s, s, s) for s in sizes}
    big = max(sizes)
    for s in sizes:
        shapes |= {(big, s, big), (big, big, s), (s, big, big)}
    out = []
    for m, n, k in sorted(shapes):
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        t = _timed(lambda: torch.matmul(a, b), sync, repeat)
        out.append((m, n, k, 2.0 * m * n * k / t))
    return out


def fit_gemm_curve(table: list[tuple[float, float, float, float]]) -> tuple[float, float]:
    """``(e_max, dim_half)`` of ``eff = e_max / (1 + d (1/m + 1/n + 1/k))``, robust to the
    samples other load slowed: for each ``e_max`` on a grid from the best efficiency seen up
    to 1, ``d`` is the median of ``(e_max / eff - 1) / x`` (``x = 1/m + 1/n + 1/k``); the pair
    with the smallest median relative error wins (a table drawn from the curve gives it back)."""
    effs = [e for *_, e in table]
    xs = [1 / m + 1 / n + 1 / k for m, n, k, _ in table]
    lo = max(effs)
    best = None
    for i in range(201):
        e_max = lo + (1.0 - lo) * i / 200
        d = max(0.0, statistics.median((e_max / e - 1) / x for e, x in zip(effs, xs)))
        err = statistics.median(abs(e_max / (1 + d * x) / e - 1) for e, x in zip(effs, xs))
        if best is None or err < best[0]:
            best = (err, e_max, d)
    return best[1], best[2]


def elementwise_bandwidth(device: str, nbytes: int, repeat: int = 7) -> float:
    import torch

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    n = max(1, nbytes // 4)
    x, y, z = (torch.randn(n, device=device) for _ in range(3))
    t = _timed(lambda: torch.add(x, y, out=z), sync, repeat)
    return 12.0 * n / t


def launch_overhead(device: str, repeat: int = 200) -> float:
    """Seconds one tiny element-wise op costs, forward and backward, per op (autograd)."""
    import torch

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    x = torch.ones(1, device=device, requires_grad=True)

    def run():
        y = x
        for _ in range(20):
            y = y * 1.0001
        y.backward()

    return _timed(run, sync, max(5, repeat // 20)) / 40        # 20 forwards + 20 backwards


def attention_efficiency(device: str, dtype, peak: float, b: int = 4, heads: int = 4,
                         s: int = 512, d: int = 64) -> float:
    """flash_e_max such that the model's flash efficiency at (s, d) equals the measured one."""
    import torch
    import torch.nn.functional as F

    from pipesim.plan.operators import flash_efficiency

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    q, k, v = (torch.randn(b, heads, s, d, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))

    def run():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()

    t = _timed(run, sync, 5)
    flops = 3 * 4 * b * heads * s * s * d / 2           # fwd + 2x bwd, causal half
    measured = flops / t / peak

    class _One:
        flash_e_max = 1.0

    return min(1.0, max(1e-3, measured / flash_efficiency(_One, s, d)))


def _allreduce_worker(rank: int, world: int, port: int, sizes, queue) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = []
    for nbytes in sizes:
        t = torch.zeros(max(1, nbytes // 4))
        dist.all_reduce(t)
        samples = []
        for _ in range(5):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            samples.append(time.perf_counter() - t0)
        out.append((nbytes, statistics.median(samples)))
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def gloo_links(sizes=(4 << 10, 256 << 10, 4 << 20, 16 << 20)) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of an all-reduce between 2 processes over gloo, fitted
    to the ring's ``2 (p-1) a + 2 (p-1)/p n / B`` at p = 2."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_worker, args=(r, 2, port, sizes, queue)) for r in range(2)]
    for p in procs:
        p.start()
    points = queue.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    # t = 2a + n/B  (p = 2): linear in n
    xs = [n for n, _ in points]
    ys = [t for _, t in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    slope = max(slope, 1e-15)
    latency = max(0.0, (my - slope * mx) / 2)
    return latency, 1 / slope


def calibrate(device: str = "cpu", name: str | None = None, links: bool = True,
              quick: bool = False) -> Hardware:
    """Measure this machine's figures and return them as a :class:`Hardware` (see above)."""
    import torch

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    sizes = SIZES[:-1] if quick else SIZES
    sweep = gemm_sweep(device, dtype, repeat=3 if quick else 5, sizes=sizes)
    peak = max(r for *_, r in sweep)
    table = tuple((m, n, k, r / peak) for m, n, k, r in sweep)
    e_max, dim = fit_gemm_curve(list(table))
    bw_small = elementwise_bandwidth(device, 4 << 20)
    bw_large = elementwise_bandwidth(device, 256 << 20 if not quick else 64 << 20)
    launch = launch_overhead(device)
    flash = attention_efficiency(device, dtype, peak)
    if device == "cpu":
        memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        label = name or f"cpu-{os.cpu_count()}core"
    else:
        memory = float(torch.cuda.get_device_properties(device).total_memory)
        label = name or torch.cuda.get_device_name(device).replace(" ", "-")
    lat, bw = gloo_links() if links else (5e-6, bw_small)
    where = f"measured by pipeexec calibrate-hardware on {label}, {time.strftime('%Y-%m-%d')}"
    sources = {
        "peaks": f"{where}: peak_flops = the best GEMM rate of the sweep ({dtype})",
        "gemm_e_max": f"{where}: median fit to gemm_table", "gemm_dim_half":
        f"{where}: median fit to gemm_table",
        "mem_efficiency": f"{where}: hbm_bandwidth is the achieved torch.add bandwidth on 4 MiB "
                          f"tensors ({bw_small / 1e9:.1f} GB/s; {bw_large / 1e9:.1f} GB/s on "
                          "large ones), so the efficiency is 1",
        "flash_e_max": f"{where}: scaled_dot_product_attention fwd+bwd at b4 h4 s512 d64",
        "launch_overhead": f"{where}: one-element mul with autograd, per op",
        "links": f"{where}: gloo all-reduce between 2 processes, latency + bandwidth fit",
        "memory_reserve": "none on a CPU (no device context)",
        "fragmentation": "1: the CPU allocator is not modelled",
    }
    return Hardware(label, peak, memory, bw, bw, bw_small, link_latency=lat, network_latency=lat,
                    nvlink_domain=1 << 20, fp8_flops=0.0 if device == "cpu" else None,
                    fp32_flops=peak if device == "cpu" else None,
                    gemm_e_max=e_max, gemm_dim_half=dim, gemm_table=table, mem_efficiency=1.0,
                    flash_e_max=flash, launch_overhead=launch,
                    memory_reserve=0.0 if device == "cpu" else 4 * 2**30,
                    fragmentation=1.0 if device == "cpu" else 1.05,
                    calibration="measured", sources=tuple(sources.items()))


def add_command(sub) -> None:
    from pipesim.cli.help import DefaultsHelpFormatter

    p = sub.add_parser("calibrate-hardware", help="measure this machine's figures for pipesim's "
                       "time model and write a hardware file (--hardware FILE)",
                       formatter_class=DefaultsHelpFormatter)
    p.add_argument("--out", required=True, metavar="FILE.json", help="the hardware file to write")
    p.add_argument("--device", default="cpu", help="cpu, or a CUDA device (cuda:0)")
    p.add_argument("--name", default=None, help="the hardware's name in the file")
    p.add_argument("--no-links", action="store_true", help="skip the gloo collectives")
    p.add_argument("--quick", action="store_true", help="a smaller sweep (tests)")


def run(ns: argparse.Namespace) -> int:
    import torch

    if ns.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"calibrate-hardware: --device {ns.device}: no CUDA device here; use --device cpu")
        return 2
    hw = calibrate(ns.device, ns.name, links=not ns.no_links, quick=ns.quick)
    hw.save(Path(ns.out))
    print(f"{hw.name}: peak {hw.peak_flops / 1e9:.1f} GFLOP/s, GEMM eff = {hw.gemm_e_max:.3f} / "
          f"(1 + {hw.gemm_dim_half:.1f} (1/m + 1/n + 1/k)), element-wise {hw.hbm_bandwidth / 1e9:.1f} "
          f"GB/s, launch {hw.launch_overhead * 1e6:.1f} us, attention {hw.flash_e_max:.3f}, "
          f"link {hw.link_bandwidth / 1e9:.2f} GB/s + {hw.link_latency * 1e6:.0f} us -> {ns.out}")
    return 0
