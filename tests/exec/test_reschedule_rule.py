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
    assert keep_searched(before, [0.0999], 0.0)
    assert not keep_searched(before, [0.100], 0.0)              # equal is not faster
