"""ZeRO as actions (`pipesim.schedule.sharding`): the pass that inserts UNSHARD / RESHARD /
REDUCE_GRAD into each rank's actions, their lowering, validation and file forms.

* Where the pass puts them, against closed forms read off the compute order: REDUCE_GRAD once
  per stage after its last backward (per_step) or after every B and W (per_microbatch);
  under ZeRO-3 an UNSHARD right before and a RESHARD right after every compute of the stage;
  sends right after their compute; ZeRO 0 and 1 insert nothing.
* Against torch.distributed.pipelining's own passes on the same compute orders:
  ``_add_reduce_grad`` (per_step) and ``_add_unshard_reshard(max_active_stages=1)`` (our
  list with each ``RESHARD s, UNSHARD s`` pair between consecutive actions of one stage
  dropped).
* The codes of the existing ops unchanged (the trace and the board store them); lowering keeps
  the compute and communication rows as they were, the sharding ones between.
* Validation refuses hand-placed sharding actions that break the rules, naming rank and action;
  JSON and torch's CSV keep them.
"""
from __future__ import annotations

import pickle

import pytest

import pipesim
from pipesim import Action, ScheduleError
from pipesim.schedule.action import B, F, I, W
from pipesim.schedule.io import (schedule_from_csv, schedule_from_json, schedule_to_csv,
                                 schedule_to_json)
from pipesim.schedule.op import Op
from pipesim.schedule.program import lower
from pipesim.schedule.sharding import Sharding, insert_sharding

SCHEDULES = [("gpipe", 2, 1, 4), ("1f1b", 4, 1, 8), ("interleaved", 2, 2, 4),
             ("zb-h1", 3, 1, 6), ("zbv", 2, 2, 4), ("dualpipev", 2, 2, 4), ("dualpipe", 2, 1, 4),
             ("looped-bfs", 2, 2, 4), ("v-half", 2, 2, 4)]
SHARD = {Op.UNSHARD.value, Op.RESHARD.value, Op.REDUCE_GRAD.value}
SENDS = {"SEND_F", "SEND_B"}


def build(name, pp, vpp, m):
    return pipesim.build_schedule(name, pp=pp, vpp=vpp, microbatches=m)


def without_sends(actions):
    return [a for a in actions if a.op not in SENDS]


def test_existing_codes_keep_their_values():
    """The trace's op column, the simulator's rows and pipeexec's board store the codes."""
    assert [op.value for op in Op][:11] == ["F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B",
                                            "RECV_B", "ALLREDUCE", "OPTIMIZER", "OVERLAP_F_B"]
    assert [Op.UNSHARD.code, Op.RESHARD.code, Op.REDUCE_GRAD.code] == [11, 12, 13]
    assert all(op.is_shard for op in (Op.UNSHARD, Op.RESHARD, Op.REDUCE_GRAD))
    assert not any(op.is_shard for op in Op if op.value not in SHARD)


@pytest.mark.parametrize("zero", [0, 1])
def test_zero_0_and_1_insert_nothing(zero):
    s = build("1f1b", 2, 1, 4)
    assert s.with_sharding(Sharding(zero)) is s
    assert insert_sharding(s.actions(0), Sharding(zero)) == s.actions(0)


@pytest.mark.parametrize("name,pp,vpp,m", SCHEDULES)
@pytest.mark.parametrize("zero,reduce", [(2, "per_step"), (2, "per_microbatch"), (3, "per_step"),
                                         (3, "per_microbatch")])
def test_the_pass_puts_each_action_where_its_rule_says(name, pp, vpp, m, zero, reduce):
    plain = build(name, pp, vpp, m)
    s = plain.with_sharding(Sharding(zero, reduce)).validate()
    for r in range(pp):
        acts = s.actions(r)
        # the pass only adds: without its actions, the list it started from
        assert [a for a in acts if a.op not in SHARD] == plain.actions(r)
        order = plain.compute_order(r)               # the closed forms read this
        steps = without_sends(acts)
        # per compute action (an overlap: its parts' stages), what must surround it
        at = {id(a): i for i, a in enumerate(steps) if a.op not in SHARD}
        want_reduce = []
        last_backward = {}
        for k, a in enumerate(order):
            for p in a.parts:
                if p.op in (B, I, W):
                    last_backward[p.stage] = k
        for k, a in enumerate(order):
            i = next(j for j, x in enumerate(steps) if x is a or x == a)
            stages = list(dict.fromkeys(p.stage for p in a.parts))
            before = steps[i - len(stages) if zero == 3 else i: i]
            if zero == 3:
                assert [(x.op, x.stage) for x in before] == [("UNSHARD", st) for st in stages], (r, a)
            reduces = [(p.stage, p.microbatch) for p in a.parts
                       if (reduce == "per_microbatch" and p.op in (B, W))
                       or (reduce == "per_step" and p.op in (B, I, W) and last_backward[p.stage] == k)]
            after = steps[i + 1: i + 1 + len(reduces) + (len(stages) if zero == 3 else 0)]
            assert [(x.op, x.stage, x.microbatch) for x in after] == (
                [("REDUCE_GRAD", st, mb) for st, mb in reduces]
                + ([("RESHARD", p.stage, p.microbatch) for p in _firsts(a.parts)]
                   if zero == 3 else [])), (r, a)
            want_reduce += reduces
        got = [(a.stage, a.microbatch) for a in acts if a.op == "REDUCE_GRAD"]
        assert got == want_reduce
        if reduce == "per_step":          # once per stage of the rank
            assert sorted(st for st, _ in got) == sorted(plain.rank_stages(r))
        else:                             # once per B and per W
            assert len(got) == sum(1 for a in plain.compute_parts(r) if a.op in (B, W))
        # sends stay right after the compute that made their tensor
        for i, a in enumerate(acts):
            if a.op in SENDS:
                j = i - 1
                while acts[j].op in SENDS:
                    j -= 1
                assert acts[j].op not in SHARD, (r, i, a)


def _firsts(parts):
    seen, out = set(), []
    for p in parts:
        if p.stage not in seen:
            seen.add(p.stage)
            out.append(p)
    return out


def _torch_actions(order):
    from torch.distributed.pipelining.schedules import _Action

    return [_Action.from_str(str(a)) for a in order]


def _text(actions):
    """The compact text form, a sharding action's without its microbatch (torch has none)."""
    return [f"{a.stage}{a.op}" if a.op in SHARD else str(a) for a in actions]


TORCH_COMPARABLE = [x for x in SCHEDULES if x[0] not in ("dualpipev", "dualpipe")]  # no overlaps


@pytest.mark.parametrize("name,pp,vpp,m", TORCH_COMPARABLE)
def test_reduce_grad_matches_torchs_pass(name, pp, vpp, m):
    from torch.distributed.pipelining.schedules import _add_reduce_grad

    plain = build(name, pp, vpp, m)
    s = plain.with_sharding(Sharding(2, "per_step"))
    for r in range(pp):
        theirs = _add_reduce_grad(_torch_actions(plain.compute_order(r)), m)
        mine = [a for a in s.actions(r) if a.is_compute or a.op == "REDUCE_GRAD"]
        assert _text(mine) == [str(a) for a in theirs], (name, r)


@pytest.mark.parametrize("name,pp,vpp,m", TORCH_COMPARABLE)
def test_unshard_reshard_matches_torchs_pass_with_one_active_stage(name, pp, vpp, m):
    from torch.distributed.pipelining.schedules import _add_unshard_reshard

    plain = build(name, pp, vpp, m)
    s = plain.with_sharding(Sharding(3, "per_step"))
    for r in range(pp):
        theirs = _add_unshard_reshard(_torch_actions(plain.compute_order(r)), max_active_stages=1)
        mine = [a for a in s.actions(r) if a.is_compute or a.op in ("UNSHARD", "RESHARD")]
        kept = []                   # torch keeps a stage whole between its consecutive actions
        for a in mine:
            if (a.op == "UNSHARD" and kept and kept[-1].op == "RESHARD"
                    and kept[-1].stage == a.stage):
                kept.pop()
                continue
            kept.append(a)
        assert _text(kept) == [str(a) for a in theirs], (name, r)


def test_lowering_keeps_the_rows_and_adds_the_sharding_ones():
    plain = build("zbv", 2, 2, 4)
    s = plain.with_sharding(Sharding(3, "per_microbatch"))
    p, q = lower(plain), lower(s)
    for r in range(2):
        rows = [row for row in q.in_turn[r] if row[0] < Op.UNSHARD.code]
        assert len(rows) == len(p.in_turn[r])
        # the same rows but their wait_row (a global row index, shifted by the new rows)
        assert [row[:4] + row[5:] for row in rows] == [row[:4] + row[5:] for row in p.in_turn[r]]
        assert q.actions(r) == s.actions(r)
        for row in q.in_turn[r]:
            if row[0] >= Op.UNSHARD.code:
                assert row[3:] == (-1,) * 8           # waits for and sends nothing
    assert q.transfers.keys() == p.transfers.keys()
    # a sharded schedule's compute rows are its compute
    assert [len(x) for x in q.compute_rows()] == [len(x) for x in p.compute_rows()]


def test_a_schedule_with_sharding_is_a_value():
    plain = build("1f1b", 2, 1, 4)
    s = plain.with_sharding(Sharding(3))
    assert s != plain and s == plain.with_sharding(Sharding(3))
    assert s.with_sharding(None) == plain
    assert pickle.loads(pickle.dumps(s)) == s
    assert s.with_orders([plain.compute_order(r) for r in range(2)]).sharding == Sharding(3)
    assert "zero=3" in repr(s)
    with pytest.raises(ScheduleError, match="ZeRO level"):
        Sharding(4)
    with pytest.raises(ScheduleError, match="grad_reduce"):
        Sharding(2, "per_layer")


def test_text_forms():
    assert Action.parse("1UNSHARD") == Action("UNSHARD", 1, -1)     # torch's, no microbatch
    assert str(Action("REDUCE_GRAD", 2, -1)) == "2REDUCE_GRAD"
    assert Action.parse("0REDUCE_GRAD3") == Action("REDUCE_GRAD", 0, 3)


@pytest.mark.parametrize("name,pp,vpp,m", [("1f1b", 2, 1, 4), ("dualpipe", 2, 1, 4)])
def test_json_keeps_the_sharding(name, pp, vpp, m):
    s = build(name, pp, vpp, m).with_sharding(Sharding(3, "per_microbatch"))
    back = schedule_from_json(schedule_to_json(s))
    assert back == s and back.sharding == Sharding(3, "per_microbatch")
    # an old file (no sharding field) loads as it did
    assert schedule_from_json(schedule_to_json(build(name, pp, vpp, m))).sharding is None


def test_torchs_csv_with_comms_carries_the_actions():
    s = build("interleaved", 2, 2, 4).with_sharding(Sharding(3))
    text = schedule_to_csv(s, with_comms=True)
    assert "UNSHARD" in text and "REDUCE_GRAD" in text
    back = schedule_from_csv(text).validate()      # hand-placed now, checked
    assert back.sharding is None
    for r in range(2):
        assert ([a for a in back.actions(r) if a.op in SHARD]
                == [a for a in s.actions(r) if a.op in SHARD])
    # torch's own form: no microbatch on the sharding actions
    torch_text = "0UNSHARD,0F0,0B0,0REDUCE_GRAD,0RESHARD\n"
    one = schedule_from_csv(torch_text).validate()
    assert [str(a) for a in one.actions(0)] == ["0UNSHARD", "0F0", "0B0", "0REDUCE_GRAD",
                                                "0RESHARD"]


@pytest.mark.parametrize("cells,match", [
    ("0UNSHARD,0F0,0B0", r"rank 0: stage 0 is gathered \(UNSHARD\) and never released"),
    ("0UNSHARD,0F0,0RESHARD,0B0", r"rank 0: action 0B0 computes stage 0 outside an UNSHARD"),
    ("0F0,0REDUCE_GRAD,0B0", r"rank 0: action 0REDUCE_GRAD reduces stage 0's gradients before"),
    ("0F0,0F1,0B0,0REDUCE_GRAD,0B1", r"rank 0: stage 0 has a backward after its last REDUCE_GRAD"),
    ("0F0,0B0,0RESHARD", r"rank 0: action 0RESHARD releases stage 0, which no UNSHARD"),
    ("0UNSHARD,0UNSHARD,0F0,0B0,0RESHARD", r"rank 0: action 0UNSHARD gathers stage 0, already"),
])
def test_validation_names_rank_action_and_reason(cells, match):
    with pytest.raises(ScheduleError, match=match):
        schedule_from_csv(cells + "\n").validate()


def test_a_sharding_action_on_another_ranks_stage_is_refused():
    with pytest.raises(ScheduleError, match=r"rank 0: action 1UNSHARD shards stage 1, which the "
                                            r"placement puts on rank 1"):
        pipesim.Schedule(2, 1, 1, "looped", [
            [Action.parse(t) for t in "0F0 0SEND_F0 0RECV_B0 1UNSHARD 0B0".split()],
            [Action.parse(t) for t in "1RECV_F0 1F0 1B0 1SEND_B0".split()]]).validate()


def test_hand_placed_actions_and_a_sharding_are_refused_together():
    one = schedule_from_csv("0UNSHARD,0F0,0B0,0RESHARD\n")
    with pytest.raises(ScheduleError, match="given by hand"):
        one.with_sharding(Sharding(3))
