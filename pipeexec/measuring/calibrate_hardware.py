"""What ``pipeexec calibrate-hardware`` measures: this machine's figures for pipesim's time model
(the command's flags and printout are `pipeexec.cli.calibrate_hardware`).

Why: pipesim's per-operator model (:mod:`pipesim.plan.operators`) reads a GEMM-efficiency
curve by shape, the bandwidth element-wise kernels reach, attention's efficiency, a per-kernel
overhead and the links; a preset carries them from datasheets and fits, a hardware file from
this machine. Measured here with torch, on the device given (CPU, or one CUDA GPU):

* GEMM sweep: ``torch.matmul`` over a grid of (m, n, k), the median of timed repeats; the peak is
  the fastest shape's rate, each shape's efficiency its rate over that peak (the table), and the
  curve ``e_max / (1 + d (1/m + 1/n + 1/k))`` fitted to it (least median error: robust to the
  samples a busy machine slowed);
* element-wise bandwidth: ``torch.add(x, y, out=z)`` (12 bytes an element in fp32) on tensors
  the size of a small model's activations (4 MiB) and on a large one; the former is stored (on
  a CPU it is what a pipeline's tensors see, in cache), the latter noted in the sources;
* the per-kernel overhead: a one-element add with autograd, forward and backward;
* attention: ``scaled_dot_product_attention`` forward + backward at one shape, as the
  ``flash_e_max`` the model's sequence and head-dim factors scale;
* collectives: the gloo benchmark of :mod:`pipeexec.measuring.collectives` (all-reduce,
  reduce-scatter, all-gather, all-to-all between p = 2 and 4 forked ranks on this host, 4 KiB
  to 25 MiB), each (collective, p) fitted as latency + bytes / bandwidth in the ring convention
  of :mod:`pipesim.plan.collectives`, stored as the file's ``collectives`` for both link kinds
  (one host: both are the loopback); the links' own pair (point-to-point, and any collective
  without a figure) is the all-reduce's at the smallest p, as the file held before. Measured
  first, before the GEMM sweep starts torch's thread pool: the benchmark forks its ranks.

On a CUDA GPU (``--device cuda``) the sizes are a GPU's (GEMMs up to 8192, bf16; element-wise
tensors of 1 GiB, past the L2; attention at a Llama layer's s 4096, d 128) and the figures are
stated against a preset's datasheet (``--base``, by default the preset the device's name
names): peak_flops stays the datasheet's dense bf16 peak, so efficiencies and MFU keep their
meaning, the GEMM table is each shape's rate over it, ``mem_efficiency`` the measured
bandwidth over the datasheet's HBM bandwidth; ``launch_overhead`` is a kernel's cost on the
device (tiny kernels replayed from a CUDA graph: when the host runs ahead, as it does in a
large model's step, its dispatch cost hides). One GPU cannot measure its links: they, the
reserve and the FP8 / FP32 peaks stay the preset's.

The file is :meth:`pipesim.hardware.Hardware.to_dict`'s JSON with ``calibration: measured``,
each figure's method in ``sources``; ``--hardware FILE`` reads it.
"""
from __future__ import annotations

import os
import statistics
import time

from pipesim.hardware import Hardware, get_hardware, hardware_names

SIZES = (64, 128, 256, 512, 1024)
GPU_SIZES = (256, 512, 1024, 2048, 4096, 8192)


def _sync(device: str):
    """What waits for ``device``'s queued work (nothing on a CPU)."""
    import torch

    return torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)


def _timed(fn, sync, repeat: int) -> float:
    fn()
    sync()
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    # The median: a run's step sums hundreds of calls, each at the machine's typical speed, not
    # at its luckiest (on this 2-core CPU a 512^3 matmul's best call is 10-20% above its
    # median); and it stays robust to other load that slows fewer than half the samples.
    return statistics.median(samples)


def gemm_sweep(device: str, dtype, repeat: int = 7, sizes=SIZES) -> list[tuple[int, int, int, float]]:
    """(m, n, k, FLOP/s) for every shape of the grid (cubes and the thin ones a layer has)."""
    import torch

    cuda = device.startswith("cuda")
    shapes = {(s, s, s) for s in sizes}
    big = max(sizes)
    for s in sizes:
        shapes |= {(big, s, big), (big, big, s), (s, big, big)}
    out = []
    for m, n, k in sorted(shapes):
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        if cuda:                # the device's time: its kernel alone (the host's is apart)
            c = torch.empty(m, n, device=device, dtype=dtype)
            t = _timed_device(lambda: torch.matmul(a, b, out=c), repeat, graph=True)
        else:
            t = _timed(lambda: torch.matmul(a, b), _sync(device), repeat)
        out.append((m, n, k, 2.0 * m * n * k / t))
    return out


def _timed_device(fn, repeat: int, batch_seconds: float = 2e-3, graph: bool = False) -> float:
    """Seconds of one call of ``fn`` on the current CUDA stream: the median over ``repeat``
    batches, each timed by CUDA events around enough back-to-back calls to fill
    ``batch_seconds`` (a single small kernel is shorter than the events' resolution).
    ``graph``: the batch is captured once as a CUDA graph and replayed, so the host's dispatch
    (tens of microseconds a call in Python) does not hide a small kernel's device time."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def batch(calls: int, body=None) -> float:
        start.record()
        if body is not None:
            body()
        else:
            for _ in range(calls):
                fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls

    batch(3)                                   # warm-up: kernel selection, allocator
    calls = max(1, min(1000, int(batch_seconds / max(batch(3), 1e-7))))
    body = None
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):          # warm-up off the capturing stream
            fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
        body = g.replay
        batch(calls, body)
    return statistics.median(batch(calls, body) for _ in range(repeat))


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
    """Bytes/s of ``torch.add(x, y, out=z)`` (fp32: 12 bytes an element) on ``device`` (on a
    GPU timed by CUDA events, `_timed_device`)."""
    import torch

    n = max(1, nbytes // 4)
    x, y, z = (torch.randn(n, device=device) for _ in range(3))
    add = lambda: torch.add(x, y, out=z)        # noqa: E731
    t = (_timed_device(add, repeat) if device.startswith("cuda")
         else _timed(add, _sync(device), repeat))
    return 12.0 * n / t


def launch_overhead(device: str, repeat: int = 200) -> float:
    """Seconds one tiny element-wise op costs, forward and backward, per op (autograd)."""
    import torch

    x = torch.ones(1, device=device, requires_grad=True)

    def run():
        y = x
        for _ in range(20):
            y = y * 1.0001
        y.backward()

    return _timed(run, _sync(device), max(5, repeat // 20)) / 40   # 20 forwards + 20 backwards


def attention_efficiency(device: str, dtype, peak: float, b: int = 4, heads: int = 4,
                         s: int = 512, d: int = 64) -> float:
    """flash_e_max such that the model's flash efficiency at (s, d) equals the measured one."""
    import torch
    import torch.nn.functional as F

    from pipesim.plan.operators import FLASH_BACKWARD, flash_efficiency

    q, k, v = (torch.randn(b, heads, s, d, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))

    def run():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()

    t = _timed(run, _sync(device), 5)
    flops = (1 + FLASH_BACKWARD) * 4 * b * heads * s * s * d / 2   # fwd + bwd, causal half
    measured = flops / t / peak

    class _One:
        flash_e_max = 1.0

    return min(1.0, max(1e-3, measured / flash_efficiency(_One, s, d)))


def gloo_collectives(groups: tuple[int, ...] | None = None, sizes: tuple[int, ...] | None = None,
                     quick: bool = False, repeats: int | None = None) -> tuple[dict, str]:
    """The benchmark's figures as :class:`Hardware` fields (``link_latency`` ... and
    ``collectives``), and what was measured, for the sources."""
    from pipesim.units import format_bytes

    from .collectives import GROUPS, QUICK_SIZES, SIZES, benchmark

    groups = groups or ((2,) if quick else GROUPS)
    sizes = sizes or (QUICK_SIZES if quick else SIZES)
    repeats = repeats or (3 if quick else 9)
    b = benchmark(groups, sizes, repeats=repeats)
    base = b.fit_of("all_reduce", min(groups))
    errors = b.errors()
    fields = dict(link_latency=base.latency, network_latency=base.latency,
                  link_bandwidth=base.bandwidth, network_bandwidth=base.bandwidth,
                  collectives=b.hardware_rows())
    what = (f"gloo {', '.join(dict.fromkeys(f.name for f in b.fits))} between p = "
            f"{', '.join(map(str, groups))} forked ranks on this host (pipeexec.measuring."
            f"collectives), {len(sizes)} sizes {format_bytes(min(sizes))} to "
            f"{format_bytes(max(sizes))}, median of {repeats} repeats after warm-up; each "
            "(collective, p) fitted as latency + bytes / bandwidth in the ring convention of "
            f"pipesim.plan.collectives (fit error median {statistics.median(errors):.1%}, worst "
            f"{max(errors):.1%}); the same figures for both link kinds (one host)")
    return fields, what


def kernel_floor(device: str, kernels: int = 200, repeat: int = 7) -> float:
    """Seconds a tiny kernel costs on the device: a chain of ``kernels`` one-element multiplies
    replayed from a CUDA graph (`_timed_device`: no host dispatch in the timing)."""
    import torch

    x = torch.ones(1, device=device)

    def chain():
        y = x
        for _ in range(kernels):
            y = y * 1.0001

    return _timed_device(chain, repeat, graph=True) / kernels


def base_preset(device: str, base: str | None) -> Hardware:
    """The preset a CUDA device's measured figures are stated against: ``base`` if given, else
    the preset whose name the device's name contains (H100 in "NVIDIA H100 80GB HBM3")."""
    import torch

    if base is not None:
        return get_hardware(base)
    label = torch.cuda.get_device_name(device).upper()
    found = [n for n in hardware_names() if n.upper() in label.replace(" ", "")
             or n.upper() in label.split()]
    if not found:
        raise ValueError(f"--device {device}: {torch.cuda.get_device_name(device)!r} names no "
                         f"preset ({', '.join(hardware_names())}): pass --base PRESET (or a "
                         "hardware file) whose datasheet figures (peaks, HBM bandwidth, links) "
                         "the measured efficiencies are stated against")
    return get_hardware(max(found, key=len))      # GB200 before B200


def calibrate_cuda(device: str = "cuda", name: str | None = None, base: str | None = None,
                   quick: bool = False) -> Hardware:
    """A CUDA GPU's efficiency figures, measured, stated against ``base``'s datasheet figures
    (see the module docstring); links, reserve and the FP8 / FP32 peaks stay ``base``'s."""
    import torch

    preset = base_preset(device, base)
    sizes = GPU_SIZES[:-1] if quick else GPU_SIZES
    sweep = gemm_sweep(device, torch.bfloat16, repeat=3 if quick else 7, sizes=sizes)
    best = max(r for *_, r in sweep)
    peak = preset.peak_flops
    table = tuple((m, n, k, min(1.0, r / peak)) for m, n, k, r in sweep)
    e_max, dim = fit_gemm_curve(list(table))
    bw_l2 = elementwise_bandwidth(device, 32 << 20)
    bw = elementwise_bandwidth(device, (256 << 20) if quick else (1 << 30))
    floor = kernel_floor(device)
    eager = launch_overhead(device)
    # attention's efficiency against the datasheet peak, at a Llama layer's shape
    flash = attention_efficiency(device, torch.bfloat16, peak, b=1, heads=8 if quick else 32,
                                 s=2048 if quick else 4096, d=128)
    free, total = torch.cuda.mem_get_info(device)
    context = total - free - torch.cuda.memory_reserved(device)
    gpu = torch.cuda.get_device_name(device)
    label = name or f"{preset.name}-measured"
    where = (f"measured by pipeexec calibrate-hardware on {gpu} (torch {torch.__version__}, "
             f"CUDA {torch.version.cuda}), {time.strftime('%Y-%m-%d')}")
    sources = dict(preset.sources)
    sources.update({
        "peaks": f"{preset.name}'s datasheet (the preset): the best GEMM of the sweep reached "
                 f"{best / 1e12:.0f} TFLOP/s bf16, {best / peak:.1%} of it",
        "gemm_e_max": f"{where}: median fit to gemm_table (bf16 torch.matmul on random data, "
                      f"{len(table)} shapes, {min(sizes)} to {max(sizes)}, replayed from CUDA "
                      "graphs; each shape's rate over the datasheet peak)",
        "gemm_dim_half": f"{where}: median fit to gemm_table",
        "mem_efficiency": f"{where}: torch.add on 1 GiB fp32 tensors, {bw / 1e12:.2f} TB/s over "
                          f"the datasheet's {preset.hbm_bandwidth / 1e12:.2f} TB/s ({bw_l2 / 1e12:.2f}"
                          " TB/s on 32 MiB, partly in L2)",
        "flash_e_max": f"{where}: scaled_dot_product_attention (causal) fwd+bwd at b1 "
                       f"h{8 if quick else 32} s{2048 if quick else 4096} d128, over the "
                       "datasheet peak, scaled to the model's long-sequence figure",
        "launch_overhead": f"{where}: one-element kernels replayed from a CUDA graph, per kernel "
                           f"(eager dispatch with autograd costs the host {eager * 1e6:.1f} us an "
                           "op, hidden while the host runs ahead of the device)",
        "memory_reserve": f"{preset.source('memory_reserve')} (measured here: the CUDA context "
                          f"and cuBLAS workspace hold {context / 2**30:.2f} GiB before NCCL)",
        "links": f"{preset.name}'s (one GPU measures no link)",
    })
    return preset.with_(name=label, memory_bytes=float(total), gemm_e_max=e_max,
                        gemm_dim_half=dim, gemm_table=table,
                        mem_efficiency=min(1.0, bw / preset.hbm_bandwidth),
                        flash_e_max=flash, launch_overhead=floor, calibration="measured",
                        sources=tuple(sources.items()))


def calibrate(device: str = "cpu", name: str | None = None, links: bool = True,
              quick: bool = False, groups: tuple[int, ...] | None = None,
              sizes: tuple[int, ...] | None = None, repeats: int | None = None,
              base: str | None = None, threads: int = 1) -> Hardware:
    """Measure this machine's figures and return them as a :class:`Hardware` (see above),
    on a CPU with ``threads`` torch threads (default 1: as each pipeexec rank runs).
    ``groups``, ``sizes``, ``repeats``: the collective benchmark's (default: its own sweep,
    a smaller one with ``quick``); ``links=False`` skips it. On CUDA: :func:`calibrate_cuda`
    against ``base``."""
    import torch

    if device.startswith("cuda"):
        return calibrate_cuda(device, name, base=base, quick=quick)
    # first, while this process has no threads: the benchmark forks its ranks
    coll, coll_what = gloo_collectives(groups, sizes, quick, repeats) if links else ({}, "")
    if device == "cpu":
        # as a pipeexec rank computes: one thread (the launcher sets OMP_NUM_THREADS=1 a rank);
        # torch's default pool of every core measured another machine on a shared host
        torch.set_num_threads(threads)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    sizes = SIZES[:-1] if quick else SIZES
    sweep = gemm_sweep(device, dtype, repeat=3 if quick else 7, sizes=sizes)
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
    if not links:
        coll = dict(link_latency=5e-6, network_latency=5e-6, link_bandwidth=bw_small,
                    network_bandwidth=bw_small)
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
        "links": (f"{where}: the gloo all-reduce's fit at the smallest p of the collective "
                  "benchmark (see collectives)" if links else "not measured (--no-links): 5 us "
                  "and the element-wise bandwidth, assumed"),
        "memory_reserve": "none on a CPU (no device context)",
        "threads": (f"{threads} torch thread(s) (torch.set_num_threads), as each pipeexec rank "
                    f"computes; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs "
                    "at the start" if device == "cpu" else "one CUDA device"),
        "fragmentation": "1: the CPU allocator is not modelled",
    }
    if links:
        sources["collectives"] = f"{where}: {coll_what}"
    return Hardware(label, peak, memory, hbm_bandwidth=bw_small, **coll, nvlink_domain=1 << 20,
                    fp8_flops=0.0 if device == "cpu" else None,
                    fp32_flops=peak if device == "cpu" else None,
                    gemm_e_max=e_max, gemm_dim_half=dim, gemm_table=table, mem_efficiency=1.0,
                    flash_e_max=flash, launch_overhead=launch,
                    memory_reserve=0.0 if device == "cpu" else 4 * 2**30,
                    fragmentation=1.0 if device == "cpu" else 1.05,
                    calibration="measured", sources=tuple(sources.items()))


def busy_note(load: float, cpus: int) -> str:
    """A warning when other work holds the CPUs ('' when it does not): a sweep on a busy host
    measures a share of a core, and every prediction from the file is then too slow."""
    if load < 0.5 * cpus:
        return ""
    return (f"the load average is {load:.1f} on {cpus} CPUs: other work is running, and what is "
            "measured now is a share of a core; calibrate on an idle machine for figures that "
            "hold (the file records the load)")
