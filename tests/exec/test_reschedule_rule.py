"""The rule that decides, after a train-time switch to a searched order, whether to keep it
(the multi-process runs are in test_reschedule.py, marked slow)."""


def test_a_searched_order_is_kept_only_if_measured_faster_by_the_margin():
    """The trial's rule on its own: medians of each side's steps after its first (the step
    right after a switch pays for the new runtime), the replaced order's the baseline."""
    from pipeexec.measuring.reschedule import keep_searched, settled

    before = [0.300, 0.100, 0.104, 0.098]             # settled: median of the last 3, 0.100
    assert settled(before) == 0.100 and settled([0.2]) == 0.2
    assert keep_searched(before, [0.5, 0.090, 0.094], 0.05)     # 8% faster: kept
    assert not keep_searched(before, [0.5, 0.097, 0.096], 0.05)  # 3.5% faster: inside the margin
    assert not keep_searched(before, [0.05, 0.120, 0.130], 0.0)  # slower once settled: not kept
    assert not keep_searched(before, [0.100, 0.100, 0.100], 0.0)  # equal is not faster


def test_one_step_a_side_decides_nothing_and_noise_raises_the_bar():
    """A switch judged on one step each (measured 129 vs 98 ms once, against 110 predicted)
    is not kept; the speed-up must beat the noise the trial measured, not the margin alone."""
    from pipeexec.measuring.reschedule import JUDGED_STEPS, keep_searched, spread

    before = [0.300, 0.100, 0.104, 0.098]
    assert JUDGED_STEPS == 2
    assert not keep_searched(before, [0.5, 0.050], 0.0)          # one counted step: no verdict
    assert not keep_searched([0.3, 0.129], [0.5, 0.098], 0.05)    # the case seen: no verdict
    assert spread([9.0, 0.100, 0.120]) == (0.120 - 0.100) / 0.110
    noisy = [0.3, 0.080, 0.120, 0.100]                           # noise 40% of the median
    assert not keep_searched(noisy, [0.5, 0.085, 0.086, 0.087], 0.05)   # 14% faster: in the noise
    assert keep_searched(before, [0.5, 0.080, 0.081, 0.082], 0.05)      # 19% faster, noise 6%


def test_under_zero_the_searched_orders_prediction_holds_its_gathers_and_reductions():
    """zb-auto searched from a ZeRO-3 run's profiled steps (a jittered ZeRO-3 ZB-H1 dressed as
    a measured run, no processes): the prediction it logs and returns (``predicted_s``) is the
    searched order lowered with the run's sharding, priced by the costs calibrated from the
    run's own UNSHARD / REDUCE_GRAD rows, as the profiled order's (``predicted_before_s``,
    which ran lowered) and the hand-made reference's are: like with like."""
    import pipesim
    from pipeexec.analysis.predict import EXECUTOR_COMM, prediction_costs
    from pipeexec.measuring.reschedule import search_from_run
    from pipesim.schedule.sharding import Sharding

    from test_compare_sharding import zero3_run

    run, profiled, _ = zero3_run()
    sharding = Sharding(3, "per_step")
    assert run.schedule.sharding == sharding
    searched, info = search_from_run(run, 1e12)
    cal = prediction_costs(run.plan.layout, run, run.central_steps())
    assert cal.costs.overlap_sharding == 0.0 and min(cal.costs.stage_values("unshard", 4)) > 0

    def predicted(schedule):
        return pipesim.simulate(schedule, cal.costs, comm=EXECUTOR_COMM, cores=cal.cores).makespan

    assert searched.sharding is None and info["sharding"] == sharding.to_dict()
    assert info["predicted_s"] == predicted(searched.with_sharding(sharding))
    assert info["predicted_before_s"] == predicted(run.schedule)
    # closed form, a floor: a rank waits for each gather, one before each of its computations
    n, times = 4, cal.costs.compute_times(4)
    unshard = cal.costs.stage_values("unshard", n)
    floor = max(sum(times[a.op][a.stage] + unshard[a.stage] for a in searched.compute_order(r))
                for r in range(4))
    assert info["predicted_s"] >= floor > predicted(searched)      # the plain order's: less
    hands = [predicted(pipesim.build_schedule(name, pp=4, microbatches=8, recv_lookahead=1)
                       .with_sharding(sharding))
             for name in ("1f1b", "zb-h1", "zb-h2")]
    assert info["margin_reference_predicted_s"] == min(hands)
    assert info["predicted_s"] <= min(hands) + 1e-12       # never predicted slower than them
