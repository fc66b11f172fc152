"""The FIFO channel model (pipesim.schedule.channels): NCCL's matching (in posting order per
communicator and pair of ranks), one in-order stream per communicator per rank, rendezvous
sends.

* pipeexec's layout (one 2-rank communicator per kind and direction, `one_way_pairs`) with the
  runtime's deferral of a boundary's first activation: every builder, a grid of pp / vpp / m /
  lookahead, two steps: no mismatch and no deadlock.
* the model can fail: a whole-pipeline communicator per (kind, direction) (torch >= 2.8 with
  device_id) deadlocks the configurations the NCCL stream model found, and a receive order
  swapped against the send order is a mismatch naming rank, action and peer.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipesim
from pipesim.schedule.action import Action
from pipesim.schedule.channels import (ChannelError, Transfer, check_channels, group_collectives,
                                       kind_and_direction, one_way_pairs, single_group,
                                       transfer_of)

GRID = [(name, pp, vpp, m, la) for name in pipesim.schedule_names() for pp in (2, 3, 4, 8)
        for vpp in (1, 2) for m in sorted({pp, 2 * pp, 4, 8, 16}) for la in (0, 1, 2, 4)]


def _build(name, pp, vpp, m, la):
    try:
        return pipesim.build_schedule(name, pp=pp, vpp=vpp, microbatches=m,
                                      recv_lookahead=la).validate()
    except pipesim.ScheduleError:
        return None


def test_model_is_torch_free():
    code = ("import sys, pipesim.schedule.channels; "
            "assert 'torch' not in sys.modules, 'pipesim imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pipeexec_layout_never_deadlocks_for_any_builder():
    checked = set()
    for name, pp, vpp, m, la in GRID:
        s = _build(name, pp, vpp, m, la)
        if s is None:
            continue
        check_channels(s, one_way_pairs, steps=2, defer_first_activation=True)
        check_channels(s, one_way_pairs, steps=1, defer_first_activation=False)
        checked.add(name)
    assert checked == set(pipesim.schedule_names())


def test_collectives_on_their_own_communicator_never_deadlock():
    """tp's (and ZeRO-2/3's) collectives inside every computation, on the group's own
    communicator as pipeexec creates it: every builder still completes."""
    checked = set()
    for name, pp, vpp, m, la in GRID:
        if m > 8 or pp == 8:
            continue
        s = _build(name, pp, vpp, m, la)
        if s is None:
            continue
        check_channels(s, one_way_pairs, steps=2, defer_first_activation=True,
                       collective_of=group_collectives)
        checked.add(name)
    assert checked == set(pipesim.schedule_names())


def test_a_collective_sharing_a_p2p_communicator_can_deadlock():
    """The model can fail: ZB-V's collectives on the communicator its activations travel on
    (torch >= 2.8's one communicator per direction) wait behind a receive posted early."""
    s = pipesim.build_schedule("zbv", pp=2, vpp=2, microbatches=8).validate()
    check_channels(s, kind_and_direction)          # without the collectives it completes
    with pytest.raises(ChannelError, match="collective over its group, behind .* which it shares "
                       "with p2p") as info:
        check_channels(s, kind_and_direction,
                       collective_of=lambda a: ("F", True) if a.is_compute else None)
    assert info.value.kind == "deadlock"


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(pipesim.schedule_names()), pp=st.integers(2, 6),
       vpp=st.integers(1, 3), m=st.integers(1, 12), la=st.integers(0, 6))
def test_pipeexec_layout_property(name, pp, vpp, m, la):
    s = _build(name, pp, vpp, m, la)
    if s is not None:
        check_channels(s, one_way_pairs, defer_first_activation=True)


# Found by the NCCL stream model with one communicator per group over the whole pipeline.
@pytest.mark.parametrize("name,pp,vpp,m,la", [("looped-bfs", 8, 2, 4, 1),
                                              ("interleaved", 4, 2, 8, 2),
                                              ("zbv", 8, 2, 16, 2)])
def test_shared_pipeline_communicator_deadlocks(name, pp, vpp, m, la):
    s = _build(name, pp, vpp, m, la)
    assert s is not None
    with pytest.raises(ChannelError, match="deadlock") as info:
        check_channels(s, kind_and_direction)
    assert info.value.kind == "deadlock" and info.value.rank >= 0 and info.value.peer >= 0
    check_channels(s, one_way_pairs, defer_first_activation=True)


def test_lazy_communicator_creation_needs_the_warm_up():
    # torch 2.6-2.7: a communicator is created at its first transfer, the host blocking until the
    # peer arrives; gpipe pp 4 m 4 lookahead 1 was seen to deadlock in the first step that way.
    s = _build("gpipe", 4, 1, 4, 1)
    with pytest.raises(ChannelError, match="creates the communicator of channel"):
        check_channels(s, one_way_pairs, defer_first_activation=True, lazy_communicators=True)
    # pipeexec creates and warms up every channel before the first step: the eager model holds
    check_channels(s, one_way_pairs, defer_first_activation=True)
    # posted right before use, creation meets no cycle here
    check_channels(_build("gpipe", 4, 1, 4, 0), one_way_pairs, defer_first_activation=True,
                   lazy_communicators=True)


def test_single_untagged_group_head_of_line_deadlock():
    # gpipe pp 2, lookahead 1: rank 0 posts RECV_B0 before SEND_F1 on the one stream; rank 1
    # needs F1's activation before it can compute and send B0's gradient.
    s = _build("gpipe", 2, 1, 2, 1)
    with pytest.raises(ChannelError, match=r"rank 0 \(step 0\) waits for 0RECV_B0"):
        check_channels(s, single_group)
    check_channels(_build("gpipe", 2, 1, 2, 0), single_group)    # posted right before use: fine


def test_swapped_receive_order_is_a_mismatch():
    A = Action
    rank0 = [A("F", 0, 0), A("SEND_F", 0, 0), A("F", 0, 1), A("SEND_F", 0, 1)]
    rank1 = [A("RECV_F", 1, 1), A("RECV_F", 1, 0), A("F", 1, 1), A("F", 1, 0)]
    s = pipesim.Schedule(2, 1, 2, "looped", [rank0, rank1], name="swapped",
                         forward_only=True).validate()
    with pytest.raises(ChannelError, match=r"rank 1's 1RECV_F1 .* would match rank 0's 0SEND_F0") \
            as info:
        check_channels(s)
    assert (info.value.rank, info.value.action, info.value.peer) == (1, A("RECV_F", 1, 1), 0)


def test_transfer_of_names_both_ends():
    s = _build("zbv", 2, 2, 4, 0)
    sends = [a for a in s.actions(1) if a.op == "SEND_F"]    # the turn of the V is local
    assert sends
    for a in sends:
        t = transfer_of(s, 1, a)
        assert t.src == 1 and t.dst == s.stage_rank(a.stage + 1) and t.kind == "F"
        assert t.boundary == a.stage
    assert str(Transfer("B", 1, 0, 0, 3)) == "gradient of stage 0 microbatch 3 (rank 1 -> 0)"
