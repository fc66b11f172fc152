"""The interleaved builder against independent transcriptions of Megatron's loops.

``legacy_megatron_lm`` and ``megatron_core`` below re-run, per rank, the compute part of
``forward_backward_pipelining_with_interleaving`` as the two Megatron generations wrote it: the
warm-up loop, the steady 1F1B loop and the cool-down loop, calling their own chunk / microbatch
helpers, with a FIFO of saved activations per chunk that the backward pops (as Megatron's
``input_tensors[chunk].pop(0)`` does). Legacy takes each forward's microbatch from a per-chunk
data-iterator counter; Core from its schedule table. Neither shares code with the builder.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipesim
from pipesim import Action, ScheduleError, build_schedule
from pipesim.schedule.builders.interleaved import interleaved_order, schedule_table


# --------------------------------------------------------------------------------------------
# Reference 1: legacy Megatron-LM (m must be a multiple of pp; m == pp runs all warm-up).
# --------------------------------------------------------------------------------------------
def legacy_megatron_lm(pp, vpp, num_microbatches, rank, forward_only=False):
    if num_microbatches % pp != 0:
        raise RuntimeError("number of microbatches is not divisible by pipeline-model-parallel-size")
    num_model_chunks = vpp
    total_num_microbatches = num_microbatches * num_model_chunks
    if forward_only:
        num_warmup_microbatches = total_num_microbatches
    elif num_microbatches == pp:
        num_warmup_microbatches = total_num_microbatches  # all_warmup_microbatches = True
    else:
        num_warmup_microbatches = (pp - rank - 1) * 2
        num_warmup_microbatches += (num_model_chunks - 1) * pp
        num_warmup_microbatches = min(num_warmup_microbatches, total_num_microbatches)
    num_microbatches_remaining = total_num_microbatches - num_warmup_microbatches

    def get_model_chunk_id(microbatch_id, forward):
        microbatch_id_in_group = microbatch_id % (pp * num_model_chunks)
        model_chunk_id = microbatch_id_in_group // pp
        if not forward:
            model_chunk_id = num_model_chunks - model_chunk_id - 1
        return model_chunk_id

    def get_microbatch_id_in_model_chunk(iteration_id):
        iteration_group_id = iteration_id // (pp * num_model_chunks)
        return iteration_group_id * pp + iteration_id % pp

    data_iterator = [0] * num_model_chunks          # next microbatch each chunk's iterator yields
    input_tensors = [[] for _ in range(num_model_chunks)]
    executed = []

    def forward_step_helper(microbatch_id):
        chunk = get_model_chunk_id(microbatch_id, forward=True)
        mb = data_iterator[chunk]
        data_iterator[chunk] += 1
        assert mb == get_microbatch_id_in_model_chunk(microbatch_id)  # the later helper agrees
        input_tensors[chunk].append(mb)
        executed.append(("F", chunk, mb))

    def backward_step_helper(microbatch_id):
        chunk = get_model_chunk_id(microbatch_id, forward=False)
        executed.append(("B", chunk, input_tensors[chunk].pop(0)))

    for k in range(num_warmup_microbatches):
        forward_step_helper(k)
    for k in range(num_microbatches_remaining):
        forward_k = k + num_warmup_microbatches
        forward_step_helper(forward_k)
        backward_k = k
        backward_step_helper(backward_k)
    if not forward_only:
        for k in range(num_microbatches_remaining, total_num_microbatches):
            backward_step_helper(k)
    return executed


# --------------------------------------------------------------------------------------------
# Reference 2: current Megatron-Core (microbatch groups, schedule table, its checks).
# --------------------------------------------------------------------------------------------
class CoreRejects(Exception):
    def __init__(self, reason):
        super().__init__(reason)
        self.reason = reason


def core_get_schedule_table(num_microbatches, num_model_chunks, microbatch_group_size_per_vp_stage):
    schedule_table = []
    for min_microbatch_id_in_group in range(0, num_microbatches, microbatch_group_size_per_vp_stage):
        if min_microbatch_id_in_group + microbatch_group_size_per_vp_stage >= num_microbatches:
            schedule_table.extend(
                [(microbatch_id, model_chunk_id)
                 for model_chunk_id in range(num_model_chunks)
                 for microbatch_id in range(min_microbatch_id_in_group, num_microbatches)])
        else:
            schedule_table.extend(
                [(microbatch_id, model_chunk_id)
                 for model_chunk_id in range(num_model_chunks)
                 for microbatch_id in range(min_microbatch_id_in_group,
                                            min_microbatch_id_in_group + microbatch_group_size_per_vp_stage)])
    return schedule_table


def core_get_pp_rank_microbatches(num_microbatches, num_model_chunks, group, pp, rank, forward_only):
    total_num_microbatches = num_microbatches * num_model_chunks
    are_all_microbatches_in_warmup = False
    if forward_only:
        num_warmup_microbatches = total_num_microbatches
    else:
        num_warmup_microbatches = (pp - rank - 1) * 2
        num_warmup_microbatches += (num_model_chunks - 1) * group
    if num_warmup_microbatches >= total_num_microbatches:
        num_warmup_microbatches = total_num_microbatches
        are_all_microbatches_in_warmup = True
    num_microbatches_remaining = total_num_microbatches - num_warmup_microbatches
    return (total_num_microbatches, are_all_microbatches_in_warmup, num_warmup_microbatches,
            num_microbatches_remaining)


def megatron_core(pp, vpp, num_microbatches, rank, group=None, forward_only=False):
    group = pp if group is None else group  # TransformerConfig's default
    if pp == 1:  # get_forward_backward_func -> forward_backward_no_pipelining
        raise CoreRejects("no pipelining does not support model chunking")
    if group > num_microbatches or group < pp:
        raise CoreRejects("group size outside [PP, M]")
    final_microbatch_group_size = num_microbatches % group
    if 0 < final_microbatch_group_size < pp:
        raise CoreRejects("final group smaller than PP")
    num_model_chunks = vpp
    (total_num_microbatches, _, num_warmup_microbatches, num_microbatches_remaining) = \
        core_get_pp_rank_microbatches(num_microbatches, num_model_chunks, group, pp, rank, forward_only)
    microbatch_id_table, model_chunk_id_table = zip(
        *core_get_schedule_table(num_microbatches, num_model_chunks, group))

    def get_model_chunk_id(virtual_microbatch_id, forward):
        model_chunk_id = model_chunk_id_table[virtual_microbatch_id % total_num_microbatches]
        if not forward:
            model_chunk_id = num_model_chunks - model_chunk_id - 1
        return model_chunk_id

    def get_microbatch_id_in_model_chunk(iteration_id, forward):
        assert forward
        return microbatch_id_table[iteration_id]

    input_tensors = [[] for _ in range(num_model_chunks)]
    executed = []

    def forward_step_helper(virtual_microbatch_id):
        chunk = get_model_chunk_id(virtual_microbatch_id, forward=True)
        mb = get_microbatch_id_in_model_chunk(virtual_microbatch_id, forward=True)
        input_tensors[chunk].append(mb)
        executed.append(("F", chunk, mb))

    def backward_step_helper(virtual_microbatch_id):
        chunk = get_model_chunk_id(virtual_microbatch_id, forward=False)
        executed.append(("B", chunk, input_tensors[chunk].pop(0)))

    for k in range(num_warmup_microbatches):
        forward_step_helper(k)
    for k in range(num_microbatches_remaining):
        forward_step_helper(k + num_warmup_microbatches)
        backward_step_helper(k)
    if not forward_only:
        for k in range(num_microbatches_remaining, total_num_microbatches):
            backward_step_helper(k)
    return executed


def as_actions(executed, pp, rank):
    return [Action(op, chunk * pp + rank, mb) for op, chunk, mb in executed]


def reference(fn, pp, vpp, m, **kw):
    """Per-rank orders from a reference, or the CoreRejects/RuntimeError it raised."""
    return [as_actions(fn(pp, vpp, m, r, **kw), pp, r) for r in range(pp)]


def orders(s):
    return [s.compute_order(r) for r in range(s.pp)]


def peak_inflight(order):
    live = peak = 0
    for a in order:
        live += 1 if a.op == "F" else -1
        peak = max(peak, live)
    return peak


# Phrases of the builder's error messages, by the reason Core rejects for.
REASON_WORDS = {
    "no pipelining does not support model chunking": "pp >= 2",
    "group size outside [PP, M]": None,  # depends on which bound: see expected_words
    "final group smaller than PP": "0 or >= pp",
}


def expected_words(reason, m, pp):
    if reason == "group size outside [PP, M]":
        return "microbatches >= pp" if m < pp else "pp <= microbatch_group_size <= microbatches"
    return REASON_WORDS[reason]


def check_against_core(pp, vpp, m, group):
    kw = {} if group is None else {"microbatch_group_size": group}
    try:
        want = reference(megatron_core, pp, vpp, m, group=group)
    except CoreRejects as e:
        with pytest.raises(ScheduleError, match="interleaved") as info:
            build_schedule("interleaved", pp=pp, vpp=vpp, microbatches=m, **kw)
        assert expected_words(e.reason, m, pp) in str(info.value)
        return False
    s = build_schedule("interleaved", pp=pp, vpp=vpp, microbatches=m, legacy_all_warmup=False, **kw)
    assert orders(s) == want, (pp, vpp, m, group)
    s.validate()
    return True


# --------------------------------------------------------------------------------------------
# Exhaustive sweeps
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pp", range(2, 9))
@pytest.mark.parametrize("vpp", range(2, 5))
def test_matches_legacy_megatron_lm_for_every_multiple_of_pp(pp, vpp):
    for m in range(pp, 4 * pp + 1, pp):
        s = build_schedule("interleaved", pp=pp, vpp=vpp, microbatches=m)
        assert orders(s) == reference(legacy_megatron_lm, pp, vpp, m), (pp, vpp, m)
        s.validate()
        assert s.pp == pp and s.vpp == vpp and s.num_stages == pp * vpp
        assert all(s.stage_rank(st_) == st_ % pp for st_ in range(pp * vpp))


@pytest.mark.parametrize("pp", range(1, 9))
@pytest.mark.parametrize("vpp", range(2, 5))
def test_default_group_size_matches_megatron_core_and_rejects_what_it_rejects(pp, vpp):
    accepted = [m for m in range(1, 4 * pp + 1) if check_against_core(pp, vpp, m, None)]
    # With the default group size Core serves exactly the multiples of pp (legacy's rule).
    assert accepted == ([] if pp == 1 else list(range(pp, 4 * pp + 1, pp)))


@pytest.mark.parametrize("pp", range(2, 9))
def test_every_group_size_matches_megatron_core(pp):
    served = 0
    for vpp in (2, 3, 4):
        for m in range(1, 4 * pp + 1):
            for group in range(max(1, pp - 1), m + 2):
                served += check_against_core(pp, vpp, m, group)
    assert served > 0


def test_legacy_and_core_agree_except_when_m_equals_pp():
    """The docstring's claim: the two Megatron generations differ only on m == pp."""
    for pp in range(2, 9):
        for vpp in range(2, 5):
            for m in range(2 * pp, 5 * pp, pp):
                assert reference(legacy_megatron_lm, pp, vpp, m) == reference(megatron_core, pp, vpp, m)
            legacy = reference(legacy_megatron_lm, pp, vpp, pp)
            core = reference(megatron_core, pp, vpp, pp)
            # Core's last rank starts 1F1B after (vpp-1)*pp forwards; legacy's never interleaves.
            assert legacy[-1] != core[-1]
            assert [a.op for a in legacy[-1]] == ["F"] * (vpp * pp) + ["B"] * (vpp * pp)


@pytest.mark.parametrize("pp", range(2, 9))
@pytest.mark.parametrize("vpp", range(2, 5))
def test_m_equals_pp_all_warmup_by_default_and_core_order_on_request(pp, vpp):
    legacy = build_schedule("interleaved", pp=pp, vpp=vpp, microbatches=pp)
    core = build_schedule("interleaved", pp=pp, vpp=vpp, microbatches=pp, legacy_all_warmup=False)
    assert orders(legacy) == reference(legacy_megatron_lm, pp, vpp, pp)
    assert orders(core) == reference(megatron_core, pp, vpp, pp)
    for s in (legacy, core):
        s.validate()
    for r in range(pp):  # every forward before any backward, on every rank
        ops = [a.op for a in legacy.compute_order(r)]
        assert ops == ["F"] * (vpp * pp) + ["B"] * (vpp * pp)


def test_legacy_option_changes_nothing_unless_m_equals_pp():
    for pp, vpp, m, g in [(2, 2, 4, None), (4, 3, 8, None), (3, 2, 7, 4), (4, 2, 5, 5), (4, 4, 12, 6)]:
        kw = {} if g is None else {"microbatch_group_size": g}
        a = build_schedule("interleaved", pp=pp, vpp=vpp, microbatches=m, **kw)
        b = build_schedule("interleaved", pp=pp, vpp=vpp, microbatches=m, legacy_all_warmup=False, **kw)
        assert orders(a) == orders(b)


# --------------------------------------------------------------------------------------------
# Hand-checked literal orders
# --------------------------------------------------------------------------------------------
def text(s):
    return [" ".join(map(str, s.compute_order(r))) for r in range(s.pp)]


def test_literal_pp2_vpp2_m4():
    # rank 0 holds stages 0 and 2, rank 1 holds 1 and 3. Warm-up: rank 0 2*1+1*2 = 4, rank 1 2.
    s = build_schedule("interleaved", pp=2, vpp=2, microbatches=4)
    assert text(s) == [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    ]


def test_literal_m_equals_pp():
    legacy = build_schedule("interleaved", pp=2, vpp=2, microbatches=2)
    assert text(legacy) == ["0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1",
                            "1F0 1F1 3F0 3F1 3B0 3B1 1B0 1B1"]
    core = build_schedule("interleaved", pp=2, vpp=2, microbatches=2, legacy_all_warmup=False)
    assert text(core) == ["0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1",     # 2 + 2 = 4: all warm-up anyway
                          "1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1"]     # 0 + 2 = 2 warm-up forwards


def test_literal_core_table_and_order_pp2_group3_m5():
    # The example in Megatron-Core's comments: PP2 N3 M5 VP2.
    table = schedule_table(5, 2, 3)
    assert [mb for _, mb in table] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for c, _ in table] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    s = build_schedule("interleaved", pp=2, vpp=2, microbatches=5, microbatch_group_size=3)
    assert text(s) == [
        "0F0 0F1 0F2 2F0 2F1 2F2 2B0 0F3 2B1 0F4 2B2 2F3 0B0 2F4 0B1 0B2 2B3 2B4 0B3 0B4",
        "1F0 1F1 1F2 3F0 3B0 3F1 3B1 3F2 3B2 1F3 1B0 1F4 1B1 3F3 1B2 3F4 3B3 3B4 1B3 1B4",
    ]
    s.validate()
    assert [interleaved_order(2, 2, r, 5, 3) for r in (0, 1)] == orders(s)


# --------------------------------------------------------------------------------------------
# Memory: peak in-flight microbatches per rank
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pp", range(2, 9))
def test_peak_inflight_is_warmup_plus_one(pp):
    for vpp in (2, 3, 4):
        for m, g in [(m, None) for m in range(pp, 4 * pp + 1, pp)] + [(2 * pp + 1, pp + 1)]:
            total = vpp * m
            s = build_schedule("interleaved", pp=pp, vpp=vpp, microbatches=m,
                               **({} if g is None else {"microbatch_group_size": g}))
            for r in range(pp):
                group = pp if g is None else g
                warmup = total if m == pp else min(2 * (pp - r - 1) + (vpp - 1) * group, total)
                order = s.compute_order(r)
                steady = warmup < total  # the steady phase runs one forward before its backward
                leading_forwards = next((i for i, a in enumerate(order) if a.op == "B"), len(order))
                assert leading_forwards == warmup + steady
                assert peak_inflight(order) == warmup + steady


# --------------------------------------------------------------------------------------------
# forward_only, vpp == 1, options
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pp,vpp,m,g", [(2, 2, 4, None), (4, 3, 8, None), (3, 2, 7, 4), (4, 2, 4, None),
                                        (5, 4, 12, 6)])
def test_forward_only_is_the_schedule_table(pp, vpp, m, g):
    kw = {} if g is None else {"microbatch_group_size": g}
    s = build_schedule("interleaved", pp=pp, vpp=vpp, microbatches=m, forward_only=True, **kw)
    assert s.forward_only
    assert orders(s) == reference(megatron_core, pp, vpp, m, group=g, forward_only=True)
    if m % pp == 0:
        assert orders(s) == reference(legacy_megatron_lm, pp, vpp, m, forward_only=True)
    s.validate()


def test_forward_only_rejects_what_training_rejects():
    with pytest.raises(ScheduleError, match="microbatches >= pp"):
        build_schedule("interleaved", pp=4, vpp=2, microbatches=3, forward_only=True)
    with pytest.raises(ScheduleError, match="0 or >= pp"):
        build_schedule("interleaved", pp=4, vpp=2, microbatches=6, forward_only=True)


@pytest.mark.parametrize("pp", range(1, 9))
def test_vpp1_is_megatrons_non_interleaved_1f1b(pp):
    for m in range(1, 3 * pp + 1):
        for forward_only in (False, True):
            s = build_schedule("interleaved", pp=pp, vpp=1, microbatches=m, forward_only=forward_only)
            want = build_schedule("1f1b", pp=pp, vpp=1, microbatches=m, forward_only=forward_only)
            assert orders(s) == orders(want)
        s = build_schedule("interleaved", pp=pp, vpp=1, microbatches=m)
        for r in range(pp):  # 1F1B's warm-up, min(pp-r-1, m), checked without the 1f1b builder
            warmup = min(pp - r - 1, m)
            ops = [a.op for a in s.compute_order(r)]
            assert ops.index("B") == warmup + (1 if warmup < m else 0)
        s.validate()


def test_bad_options_raise_schedule_error():
    with pytest.raises(ScheduleError, match="unknown option.*chunks"):
        build_schedule("interleaved", pp=2, vpp=2, microbatches=4, chunks=3)
    for bad in (0, -2, 2.5, True, "4"):
        with pytest.raises(ScheduleError, match="microbatch_group_size must be a positive integer"):
            build_schedule("interleaved", pp=2, vpp=2, microbatches=4, microbatch_group_size=bad)
    with pytest.raises(ScheduleError, match="pp >= 2"):
        build_schedule("interleaved", pp=1, vpp=3, microbatches=4)


def test_remainder_error_suggests_group_sizes_that_work():
    with pytest.raises(ScheduleError) as info:
        build_schedule("interleaved", pp=4, vpp=2, microbatches=10)
    message = str(info.value)
    assert "10 % 4 = 2" in message and "pp = 4" in message
    # g in [4, 10] with 10 % g == 0 or >= 4: 5 (0), 6 (4), 10 (0); not 7, 8, 9 (3, 2, 1)
    assert "work for microbatches = 10: 5, 6, 10" in message
    for g in (5, 6, 10):
        build_schedule("interleaved", pp=4, vpp=2, microbatches=10, microbatch_group_size=g).validate()


def test_registered_with_looped_placement():
    assert "interleaved" in pipesim.schedule_names()
    info = pipesim.schedule_info("interleaved")
    assert info.placement == "looped"
    assert "microbatches >= pp" in info.constraints


def test_large_schedule_builds_cheaply():
    s = build_schedule("interleaved", pp=64, vpp=4, microbatches=1024)
    assert s.num_compute_actions == 64 * 4 * 1024 * 2
    # rank 0 warms up with 2*63 + 3*64 = 318 forwards; forward 318 is row 62 of the second
    # group of 64 (chunk 0, microbatch 126); backward 0 is chunk 3 (stage 192), microbatch 0.
    first = s.compute_order(0)
    assert [a.op for a in first[:318]] == ["F"] * 318
    assert first[318:320] == [Action("F", 0, 126), Action("B", 192, 0)]


# --------------------------------------------------------------------------------------------
# Larger ranges
# --------------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(pp=st.integers(2, 16), vpp=st.integers(2, 6), data=st.data())
def test_hypothesis_matches_megatron_core(pp, vpp, data):
    m = data.draw(st.integers(1, 6 * pp), label="microbatches")
    group = data.draw(st.one_of(st.none(), st.integers(1, m + 2)), label="group")
    check_against_core(pp, vpp, m, group)
    if m % pp == 0 and group is None:
        s = build_schedule("interleaved", pp=pp, vpp=vpp, microbatches=m)
        assert orders(s) == reference(legacy_megatron_lm, pp, vpp, m)
