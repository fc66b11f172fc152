"""The per-operator time model (pipesim.plan.operators), hardware data and files, utilisation
bounds, the memory reserve; and the fit against the two published tables it is fitted on."""
import importlib.util
import json
import math
import pathlib
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipesim
from pipesim.errors import PlanError
from pipesim.hardware import get_hardware
from pipesim.plan.flops import layer_flops
from pipesim.plan.model import ModelSpec
from pipesim.plan.operators import layer_ops, pass_times
from pipesim.plan.parallelism import Parallelism

ROOT = pathlib.Path(__file__).parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_cost_model",
                                                  ROOT / "benchmarks" / "bench_cost_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_fit_tables_are_within_4_percent_median_8_percent_worst():
    """Korthikanti et al. 2022 Table 5 (8 runs) and Narayanan et al. 2021 Table 1 (10 runs),
    both transcribed with their sources in benchmarks/: median |error| <= 4%, worst <= 8%, the
    bounds the README and docs/planning.md state (measured 3.4% / 6.7%; targets 5% / 15%)."""
    bench = _bench()
    # the transcriptions themselves (SC21 Table 1's first and last rows)
    assert bench.NARAYANAN_TABLE1[0] == ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137)
    assert bench.NARAYANAN_TABLE1[-1] == ("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163)
    rows = bench.fit_rows()
    assert len(rows) == 18
    errs = [abs(e) for e in bench.errors(bench.predict(rows))]
    assert statistics.median(errs) <= 0.04 and max(errs) <= 0.08, errs


def test_llama3_405b_at_table4_layouts_is_checked_not_fitted():
    """Grattafiori et al. 2024, "The Llama 3 Herd of Models", Table 4 (transcribed here and in
    the benchmark): 405B on 8,192 / 16,384 H100s at 430 / 400 / 380 TFLOP/s a GPU. A check the
    model was never fitted on: the planner finds a plan within memory at each published layout,
    its step time is within 30% of the published one (README: 17-24% slow), and the strong
    scaling at a fixed batch (32 -> 16 microbatches a replica) costs MFU, as published."""
    bench = _bench()
    assert bench.LLAMA3_TABLE4 == [(8192, 8, 1, 16, 64, 8192, 430),
                                   (16384, 8, 1, 16, 128, 8192, 400),
                                   (16384, 8, 16, 16, 8, 131072, 380)]
    rows = [r for r in bench.check_rows() if r[0].startswith("Llama 3")]
    assert len(rows) == 3
    for (_, name, plan, _), (gpus, tp, cp, pp, dp, seq, _) in zip(rows, bench.LLAMA3_TABLE4):
        p = plan.parallelism
        assert (plan.world_size, p.tp, p.cp, p.pp, p.dp, plan.model.seq_length) == (gpus, tp, cp, pp, dp, seq)
        assert pipesim.simulate(plan).fits, name
    predicted = bench.predict(rows)
    assert all(abs(e) <= 0.30 for e in bench.errors(predicted)), bench.errors(predicted)
    mfu_8k, mfu_16k = predicted[0][4], predicted[1][4]
    assert mfu_16k < mfu_8k


def test_other_gpus_gemm_efficiency_is_a100s_fit_scaled_by_measured_matmul_efficiency():
    """Bekman, ml-engineering, "Maximum Achievable Matmul FLOPS comparison table" (bf16):
    A100 SXM 86.9%, H100 SXM 80.3%, MI300X 51.4% of peak; the fitted A100 figure scaled by it."""
    a100 = get_hardware("A100").gemm_e_max
    assert get_hardware("H100").gemm_e_max == pytest.approx(a100 * 0.803 / 0.869, abs=1e-3)
    assert get_hardware("MI300X").gemm_e_max == pytest.approx(a100 * 0.514 / 0.869, abs=1e-3)
    assert "MAMF" in get_hardware("H100").source("gemm_e_max")
    assert get_hardware("A100").source("gemm_e_max").startswith("fitted")


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("tp, cp, flash", [(1, 1, True), (4, 2, True), (2, 1, False)])
def test_gemm_and_attention_flops_equal_the_flop_count(moe, tp, cp, flash):
    """The operators' FLOPs (router aside, which Megatron does not count) are flops.py's
    per-layer count on one tp x cp rank, causal-halved with flash attention."""
    model = pipesim.plan.model.PRESETS["mixtral-8x7b"] if moe else \
        pipesim.plan.model.PRESETS["llama3-8b"]
    par = Parallelism(tp=tp, cp=cp, dp=8, ep=4 if moe else 1, micro_batch_size=2,
                      flash_attention=flash)
    ops = layer_ops(model, par, moe)
    lf = layer_flops(model, 2, moe=moe, causal=flash)
    counted = sum(o.flops for o in ops if o.counted)
    assert counted == pytest.approx(lf.forward / (tp * cp), rel=1e-12)
    gemm = sum(o.flops for o in ops if o.kind == "gemm" and o.counted)
    assert gemm == pytest.approx(lf.gemm / (tp * cp), rel=1e-12)


def test_a_layers_rooflines_are_made_once_and_depend_on_its_own_knobs_alone():
    """layer_rooflines is layer_ops and its pass times (all operators; the attention core's
    alone), kept per distinct layer: plans that differ in pp, dp, ZeRO, recomputation or the
    batch share one; a knob the layer reads (here the dispatcher) makes another."""
    from pipesim.plan.operators import layer_rooflines

    model = pipesim.plan.model.PRESETS["mixtral-8x7b"]
    hw = get_hardware("H100")
    par = Parallelism(tp=2, sequence_parallel=True, cp=2, dp=4, ep=4, micro_batch_size=2,
                      precision="fp8")
    ops, pt, at = layer_rooflines(model, par, hw, True)
    fresh = layer_ops(model, par, True)
    assert list(ops) == fresh
    assert pt == pass_times(fresh, hw, "fp8")
    assert at == pass_times([o for o in fresh if o.kind == "attention"], hw, "fp8")
    same = par.with_(pp=4, vpp=2, dp=8, zero=1, recompute="selective", global_batch_size=64)
    assert layer_rooflines(model, same, hw, True) is layer_rooflines(model, par, hw, True)
    other = layer_rooflines(model, par.with_(ep_dispatcher="deepep"), hw, True)
    assert other[1] != pt


def test_each_operator_is_a_roofline_plus_a_launch():
    hw = get_hardware("A100")
    from pipesim.plan.operators import Op

    mem = Op("norm", "memory", 0.0, 1e9, bwd_bytes=3e9)
    t = pass_times([mem], hw, "bf16")
    rate = hw.hbm_bandwidth * hw.mem_efficiency
    assert t.F == pytest.approx(1e9 / rate + hw.launch_overhead)
    assert t.I == pytest.approx(3e9 / rate + hw.launch_overhead) and t.W == 0
    m, n, k = 8192, 8192, 8192
    g = Op("fc", "gemm", 2 * m * n * k, 2 * (m * k + k * n + m * n), (m, n, k), weights=True)
    t = pass_times([g], hw, "bf16")
    eff = hw.gemm_e_max / (1 + hw.gemm_dim_half * 3 / 8192)
    assert t.F == pytest.approx(2 * m * n * k / (hw.peak_flops * eff) + hw.launch_overhead)
    assert t.I == pytest.approx(t.F) and t.W == pytest.approx(t.F)      # square: same shape
    # a thin GEMM is memory-bound: its bytes over the bandwidth
    thin = Op("thin", "gemm", 2 * 8192 * 8192 * 1, 2 * (8192 + 8192 * 8192 + 8192), (8192, 8192, 1))
    assert pass_times([thin], hw, "bf16").F == pytest.approx(thin.bytes / rate + hw.launch_overhead)


def test_one_width_two_speeds_memory_bound_work_separates_small_tp1_from_wide_tp8():
    """What the one-curve model could not tell apart: hidden/tp equal, the tp-1 small model
    spends a larger share in norms, dropout and residuals (not split over tp without sequence
    parallelism; they scale with h while GEMMs scale with h^2 / tp): its achieved fraction of
    peak is lower."""
    small = pipesim.Plan.create(ModelSpec("s", 4, 2048, 16, 2048, 51200), "A100", tp=1,
                                global_batch_size=1, flash_attention=False)
    wide = pipesim.Plan.create(ModelSpec("w", 4, 16384, 128, 2048, 51200), "A100", tp=8,
                               global_batch_size=1, flash_attention=False)
    assert small.derive().efficiency < wide.derive().efficiency
    old_curve = 0.80 * 2048 / (2048 + 470)        # the one curve gave both the same
    assert abs(small.derive().efficiency - wide.derive().efficiency) > 0.02 * old_curve


# -- utilisation never above 100% ----------------------------------------------------------------
@st.composite
def random_plans(draw):
    model = draw(st.sampled_from(["llama3-8b", "gpt3-1.3b", "mixtral-8x7b", "tiny", "llama3-70b"]))
    hw = draw(st.sampled_from(["A100", "H100", "B200", "MI300X", "GB200"]))
    tp, pp, dp = draw(st.sampled_from([1, 2, 4, 8])), draw(st.sampled_from([1, 2, 4])), \
        draw(st.sampled_from([1, 2, 4, 8]))
    mbs, m = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 4, 8]))
    precisions = ["bf16", "fp16", "fp32"] + (["fp8"] if get_hardware(hw).has_fp8 else [])
    kw = dict(tp=tp, pp=pp, dp=dp, micro_batch_size=mbs, global_batch_size=mbs * dp * m,
              sequence_parallel=draw(st.booleans()), zero=draw(st.sampled_from([0, 1, 2, 3])),
              recompute=draw(st.sampled_from(["none", "selective", "full"])),
              precision=draw(st.sampled_from(precisions)),
              flash_attention=draw(st.booleans()),
              schedule=draw(st.sampled_from(["1f1b", "zb-h1", "gpipe"])))
    if model == "mixtral-8x7b":
        kw["ep"] = draw(st.sampled_from([e for e in (1, 2, 4, 8) if dp % e == 0]))
    # no communication at all: the most favourable case for the bound
    kw.update(intra_bandwidth=math.inf, inter_bandwidth=math.inf, intra_latency=0.0,
              inter_latency=0.0)
    spec = pipesim.plan.model.PRESETS[model]
    spec = spec.with_(seq_length=draw(st.sampled_from([512, 2048, 8192, 32768])))
    return pipesim.Plan.create(spec, hw, **kw)


@settings(max_examples=80, deadline=None)
@given(random_plans())
def test_mfu_and_hfu_are_never_above_100_percent(plan):
    """Against the bf16 dense peak (MFU's definition) and even with free links: no operator
    runs faster than its precision's peak, so a bf16 / fp16 / fp32 plan stays at or under
    100%, and a low-precision plan (fp8 GEMMs at the FP8 peak) under that peak over bf16's."""
    try:
        plan.validate()
    except PlanError:
        return
    r = pipesim.simulate(plan, validate=False)
    hw, precision = plan.cluster.hardware, plan.parallelism.precision
    bound = 1.0 if precision in ("bf16", "fp16", "fp32") else \
        hw.precision_peak(precision) / hw.peak_flops
    assert 0 < r.mfu <= r.hfu <= bound, (r.mfu, r.hfu, plan)


def test_fp8_is_faster_than_bf16_on_h100_and_refused_on_a100():
    bf = pipesim.Plan.create("llama3-8b", "H100", global_batch_size=1)
    f8 = bf.with_(precision="fp8")
    assert pipesim.simulate(f8).step_time < pipesim.simulate(bf).step_time
    assert pipesim.simulate(f8).mfu <= 1
    with pytest.raises(PlanError, match="parallelism.precision: precision fp8 needs FP8"):
        pipesim.Plan.create("llama3-8b", "A100", global_batch_size=1, precision="fp8").validate()


# -- hardware data and files -----------------------------------------------------------------
def test_every_preset_names_the_source_of_each_time_model_figure():
    from pipesim.hardware import FITTED, hardware_names

    for name in hardware_names():
        hw = get_hardware(name)
        for figure in ("gemm_e_max", "gemm_dim_half", "mem_efficiency", "flash_e_max",
                       "launch_overhead", "memory_reserve", "fragmentation"):
            assert hw.source(figure), (name, figure)
        # A100 fitted on its two tables; the GPUs of pipesim/data/fitted.json on
        # Megatron-Bridge's published runs (bench_published.py --fit); the rest carried over
        fitted = name == "A100" or name in FITTED["gpus"]
        assert hw.calibration == ("fitted" if fitted else "extrapolated")
        for figure in FITTED["gpus"].get(name, {}):
            assert "Megatron-Bridge" in hw.source(figure), (name, figure)


def test_a_hardware_file_round_trips_and_is_read_wherever_a_preset_name_is(tmp_path):
    hw = get_hardware("H100").with_(name="mine", gemm_e_max=0.5, calibration="measured",
                                    gemm_table=((1024, 1024, 1024, 0.4),))
    path = tmp_path / "mine.json"
    hw.save(path)
    assert get_hardware(str(path)) == hw
    plan = pipesim.Plan.create("llama3-8b", str(path), global_batch_size=1)
    assert plan.cluster.hardware == hw and not plan.derive().extrapolated
    # slower GEMMs, slower step
    base = pipesim.Plan.create("llama3-8b", "H100", global_batch_size=1)
    assert pipesim.simulate(plan).step_time > pipesim.simulate(base).step_time
    # a preset whose figures are carried over says so (H100's are fitted: fitted.json)
    carried = pipesim.Plan.create("llama3-8b", "H200", global_batch_size=1)
    assert carried.derive().extrapolated and \
        "extrapolated" in pipesim.simulate(carried).summary_text()
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**hw.to_dict(), "gemm_emax": 0.5}))
    with pytest.raises(ValueError, match="unknown hardware field.*gemm_emax"):
        get_hardware(str(bad))
    bad.write_text(json.dumps({**hw.to_dict(), "mem_efficiency": 1.5}))
    with pytest.raises(ValueError, match="mem_efficiency must be in"):
        get_hardware(str(bad))


# -- memory: a reserve and fragmentation, shown apart from the tensors --------------------------
def test_memory_reserve_and_fragmentation_decide_the_fit_not_the_tensor_counts():
    plan = pipesim.Plan.create("llama3-8b", "H100", tp=2, pp=2, global_batch_size=8)
    r = pipesim.simulate(plan)
    hw = plan.cluster.hardware
    assert r.usable_memory == pytest.approx((hw.memory_bytes - hw.memory_reserve) / hw.fragmentation)
    assert r.headroom == pytest.approx(r.usable_memory - max(r.peak_memory))
    assert r.fits == (r.headroom >= 0)
    # the tensors are unchanged by the reserve; the fit moves
    peak = max(r.peak_memory)
    tight = plan.with_(cluster=plan.cluster.with_(
        hardware=hw.with_(memory_reserve=hw.memory_bytes - peak * 1.01, fragmentation=1.0)))
    rt = pipesim.simulate(tight)
    assert max(rt.peak_memory) == peak and rt.fits
    tighter = tight.with_(cluster=tight.cluster.with_(hardware=tight.cluster.hardware.with_(
        fragmentation=1.02)))
    rr = pipesim.simulate(tighter)
    assert not rr.fits and "reserve" in rr.fit_message
    d = r.to_dict()
    assert d["memory_reserve"] == hw.memory_reserve and d["fragmentation"] == hw.fragmentation
    assert d["headroom"] == pytest.approx(r.headroom)
