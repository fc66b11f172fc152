"""The per-operator cost model against every published run transcribed here, side by side.

Fitted on (and only on) two tables, both Megatron-LM on A100 80GB (Selene: 8 GPUs a node, 8
HDR 200 Gb/s NICs):

* Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
  Table 3 (configurations) and Table 5 (iteration seconds, full recomputation and SP +
  selective), transcribed in ``benchmarks/plan_vs_published.py``;
* Narayanan et al. 2021 (SC21), "Efficient Large-Scale Language Model Training on GPU Clusters
  Using Megatron-LM", Table 1 (weak scaling, 1.7B to 1T: achieved TFLOP/s per GPU by the
  paper's eq. 3, full recomputation, s = 2048, V = 51200), transcribed below.

Checks (never fitted): torchtitan's published Llama 3.1 8B runs on H100
(``benchmarks/llama3_h100_202412_torchtitan.md`` in pytorch/torchtitan, Tables 1 and 3), and
Llama 3 405B's pre-training on 8,192 and 16,384 H100s (Grattafiori et al. 2024, "The Llama 3
Herd of Models", Table 4: strong scaling at a fixed 16M-token batch and 131k-token context).
The knobs a paper does not publish (for Llama 3: the interleaving depth, recomputation,
optimizer sharding) are what pipesim's planner picks within memory for the published layout,
chosen before looking at the published figure, never tuned to it.

    python3 benchmarks/bench_cost_model.py          # predicted vs published, every row
    python3 benchmarks/bench_cost_model.py --fit    # refit A100's figures on the fit rows

Targets: median error <= 5%, worst <= 15% over the fit tables (measured 3.4% / 6.7%, which
tests/test_cost_model.py bounds at 4% / 8%).
"""
from __future__ import annotations

import argparse
import importlib.util
import pathlib
import statistics
import time

import pipesim
from pipesim.hardware import get_hardware
from pipesim.plan.model import ModelSpec, PRESETS

_here = pathlib.Path(__file__).parent
_spec = importlib.util.spec_from_file_location("plan_vs_published", _here / "plan_vs_published.py")
_pvp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_pvp)

# Narayanan et al. 2021 (SC21, arXiv 2104.04473), Table 1: params (B), attention heads, hidden,
# layers, tensor-parallel size, pipeline-parallel size, GPUs, batch size, achieved TFLOP/s per
# GPU. Run settings not in the table, as assumed here: micro batch 1, the non-interleaved 1F1B
# schedule, full activation recomputation (the paper's eq. 3 counts it), fp16 mixed precision,
# dropout, the data-parallel all-reduce after the backward (Megatron 2021: not overlapped).
NARAYANAN_TABLE1 = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    ("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
]

# torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (pytorch/torchtitan): Llama 3.1 8B,
# FSDP (ZeRO-3), local batch 2, selective activation checkpointing, no torch.compile, bf16;
# H100 SXM with 96 GB HBM2e at 2.4 TB/s, 500 W; seq 8192 (torchtitan's llama3 8B default).
# (table, GPUs, tokens/s per GPU)
TORCHTITAN_8B = [("Table 1", 8, 5762), ("Table 3", 128, 5605)]

# Grattafiori et al. 2024 (arXiv 2407.21783), "The Llama 3 Herd of Models", Table 4: Llama 3
# 405B pre-training, bf16 on H100 SXM 80 GB 700 W (8 a node on NVLink, RoCE 400 Gb/s between),
# Megatron-style interleaved 1F1B over pp 16, FSDP-style data parallelism, 16M tokens a batch,
# micro batch 1. (GPUs, tp, cp, pp, dp, sequence length, TFLOP/s per GPU)
LLAMA3_TABLE4 = [
    (8192, 8, 1, 16, 64, 8192, 430),
    (16384, 8, 1, 16, 128, 8192, 400),
    (16384, 8, 16, 16, 8, 131072, 380),
]
LLAMA3_TOKENS = 16 * 2 ** 20


def narayanan_seconds(heads, h, l, gpus, B, tflops, s=2048, V=51200) -> float:
    """The paper's eq. 3 (with recomputation) over the achieved TFLOP/s: iteration seconds."""
    flops = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    return flops / (gpus * tflops * 1e12)


def fit_rows(hardware=None):
    """(table, name, plan, published seconds) for the 18 runs the A100 figures are fitted on."""
    hw = get_hardware("A100") if hardware is None else hardware
    rows = [("Korthikanti T5", f"{name} {method}", plan.with_(cluster=plan.cluster.with_(hardware=hw)), pub)
            for name, method, plan, pub in _pvp.plans()]
    for name, heads, h, l, tp, pp, gpus, B, tflops in NARAYANAN_TABLE1:
        model = ModelSpec(f"gpt-{name}", l, h, heads, 2048, 51200)
        dp = gpus // (tp * pp)
        plan = pipesim.Plan.create(model, hw, schedule="1f1b", tp=tp, pp=pp, dp=dp,
                                   micro_batch_size=1, global_batch_size=B, recompute="full",
                                   flash_attention=False, precision="fp16",
                                   overlap_grad_reduce=False, overlap_param_gather=False)
        rows.append(("Narayanan T1", name, plan, narayanan_seconds(heads, h, l, gpus, B, tflops)))
    return rows


def check_rows():
    """Published runs the model was not fitted on: (table, name, plan, published seconds)."""
    h100 = get_hardware("H100").with_(name="H100-96GB-500W", memory_bytes=96e9, hbm_bandwidth=2.4e12)
    model = PRESETS["llama3-8b"].with_(seq_length=8192)
    out = []
    for table, gpus, tps in TORCHTITAN_8B:
        plan = pipesim.Plan.create(model, h100, dp=gpus, zero=3, micro_batch_size=2,
                                   global_batch_size=2 * gpus, recompute="selective")
        out.append((f"torchtitan {table}", f"llama3.1-8b {gpus} GPUs",
                    plan, 2 * gpus * 8192 / (tps * gpus)))
    for gpus, tp, cp, pp, dp, seq, tflops in LLAMA3_TABLE4:
        plan = llama3_plan(gpus, tp, cp, pp, dp, seq)
        # published seconds: the step's model FLOPs (causal attention, as Meta counts them) at
        # the published rate
        seconds = plan.derive().model_flops / (gpus * tflops * 1e12)
        out.append(("Llama 3 T4", f"405b {gpus // 1024}k cp{cp} s{seq // 1024}k", plan, seconds))
    return out


def llama3_plan(gpus: int, tp: int, cp: int, pp: int, dp: int, seq: int) -> "pipesim.Plan":
    """The planner's fastest plan within memory at Table 4's published layout: the
    interleaved schedule, its depth, recomputation and ZeRO stage left to the search."""
    from pipesim.planner.enumerate import SearchSpace
    from pipesim.planner.search import search
    space = SearchSpace(PRESETS["llama3-405b"], gpus, LLAMA3_TOKENS // seq, hardware="H100",
                        seq_length=seq, schedules=("interleaved",), tp=(tp,), cp=(cp,),
                        pp=(pp,), dp=(dp,), mbs=(1,))
    best = search(space, workers=1).best
    if best is None:
        raise RuntimeError(f"no plan of Llama 3 405B at tp {tp} cp {cp} pp {pp} dp {dp} fits")
    return best


def predict(rows):
    out = []
    for table, name, plan, pub in rows:
        r = pipesim.simulate(plan)
        out.append((table, name, pub, r.step_time, r.mfu))
    return out


def errors(predicted) -> list[float]:
    return [p / pub - 1 for _, _, pub, p, _ in predicted]


def fit():
    """Grid search of A100's gemm_e_max, gemm_dim_half, mem_efficiency minimising the median
    plus the worst error (both targets) over the fit rows."""
    best = None
    base = get_hardware("A100")
    for e_max in (0.70, 0.74, 0.78, 0.82):
        for dim in (30.0, 60.0, 120.0):
            for mem in (0.7, 0.85):
                hw = base.with_(gemm_e_max=e_max, gemm_dim_half=dim, mem_efficiency=mem)
                errs = [abs(e) for e in errors(predict(fit_rows(hw)))]
                score = statistics.median(errs) + max(errs)
                if best is None or score < best[0]:
                    best = (score, e_max, dim, mem)
                    print(f"  e_max {e_max} dim_half {dim} mem {mem}: median "
                          f"{statistics.median(errs):.1%} worst {max(errs):.1%}", flush=True)
    return best[1:]


def table(predicted, title: str) -> list[float]:
    print(title)
    print(f"{'source':<15} {'run':<22} {'published s':>11} {'pipesim s':>10} {'error':>7} {'MFU':>6}")
    errs = []
    for (source, name, pub, pred, mfu) in predicted:
        err = pred / pub - 1
        errs.append(err)
        print(f"{source:<15} {name:<22} {pub:>11.3f} {pred:>10.3f} {err:>+7.1%} {mfu:>6.1%}")
    a = [abs(e) for e in errs]
    print(f"median |error| {statistics.median(a):.1%}, worst {max(a):.1%} over {len(a)} rows\n")
    return errs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true", help="refit A100's figures on the fit tables")
    args = ap.parse_args()
    t0 = time.perf_counter()
    hw = get_hardware("A100")
    if args.fit:
        e_max, dim, mem = fit()
        hw = hw.with_(gemm_e_max=e_max, gemm_dim_half=dim, mem_efficiency=mem)
        print(f"fitted: gemm_e_max {e_max}, gemm_dim_half {dim}, mem_efficiency {mem}")
    print(f"A100: gemm_e_max {hw.gemm_e_max}, gemm_dim_half {hw.gemm_dim_half}, mem_efficiency "
          f"{hw.mem_efficiency}, flash_e_max {hw.flash_e_max}, launch {hw.launch_overhead * 1e6:.0f} us\n")
    errs = table(predict(fit_rows(hw)), "fit tables (Korthikanti Table 5, Narayanan Table 1):")
    a = [abs(e) for e in errs]
    ok = statistics.median(a) <= 0.05 and max(a) <= 0.15
    checks = check_rows()
    predicted = predict(checks)
    table(predicted, "checks, not fitted (H100 figures extrapolated from A100's fit):")
    for source, name, plan, _ in checks:
        if source.startswith("Llama 3"):
            p = plan.parallelism
            print(f"  {name}: the planner's pick, vpp {p.vpp} recompute {p.recompute} zero {p.zero}")
    llama = [row for row in predicted if row[0].startswith("Llama 3")]
    pub_fall = 1 - LLAMA3_TABLE4[1][-1] / LLAMA3_TABLE4[0][-1]
    print(f"strong scaling 8k -> 16k GPUs at 16M tokens (m 32 -> 16 a replica): MFU falls "
          f"{1 - llama[1][4] / llama[0][4]:.1%} in pipesim, {pub_fall:.1%} published\n")
    print(f"targets (median <= 5%, worst <= 15% on the fit tables): {'met' if ok else 'NOT met'}"
          f"   ({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
