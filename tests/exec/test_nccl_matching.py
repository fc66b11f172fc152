"""NCCL's point-to-point matching emulated on gloo (``nccl_matching``: every tag 0, so a
channel's transfers between two ranks match in posting order, as NCCL matches them whatever the
tag): every schedule, pp 2 and 4, dp 1 and (at pp 2) 2, receive lookahead 0, 1 and 2, fp32,
two steps.

* losses and parameters equal independent single-process training (rtol 1e-5, atol 1e-6 on
  parameters, as in test_exec_equivalence);
* what the runtime REALLY posts (`P2P.record_posting`), per channel: the sender's sequence
  (header / data, kind, boundary, microbatch) equals the receiver's, which is what NCCL needs,
  and the receiver's data receives come in the schedule's RECV order on that channel.

Before the fix (receives of a boundary's first activation deferred, later ones posted at once)
gpipe and looped-bfs at pp 2, lookahead 1 gave losses [3.466205, 3.472553] and
[3.466205, 3.470194] against the reference [3.473182, 3.466463].
One launch per layout runs every case, so the grid takes about a minute on 2 cores.
"""
from __future__ import annotations

import functools

import pytest
import torch

import pipesim
from pipesim.schedule.channels import transfer_of
from pipeexec import launch
from pipeexec.config import ConfigError
from pipeexec.topology import channel_keys, destroy_topology, init_topology
from pipeexec.training.train import train
from pipeexec.run.assemble import assemble

from exec_helpers import (GLOBAL_BATCH, MICROBATCHES, TINY, assert_grad_norms, choose_microbatches,
                          layout_config, reference_run, reference_train)

pytestmark = pytest.mark.slow

STEPS = 2
LOOKAHEADS = (0, 1, 2)
# dp 2 at pp 2 only: each replica's pipeline channels are its own pairs of ranks (dp's
# all-reduce runs on its own communicator), so pp 4 x dp 2 would repeat pp 2 x dp 2's check
# on 8 processes
LAYOUTS = [(2, 1), (2, 2), (4, 1)]
REF_CFG = TINY.with_flat(microbatches=MICROBATCHES, micro_batch_size=GLOBAL_BATCH // MICROBATCHES,
                         steps=STEPS)


def matching_worker(board, pp: int, dp: int, cases: list[tuple[str, int]]) -> dict:
    topo = init_topology(pp, dp, device="cpu", timeout=120)
    out = {}
    # this rank's channels: the 2-rank groups of the ring-neighbour pairs it is an end of
    assert set(topo.p2p_groups) == {k for k in channel_keys(pp) if topo.pp_rank in k[1:]}
    try:
        for schedule, lookahead in cases:
            cfg = layout_config(schedule, pp, dp, steps=STEPS, recv_lookahead=lookahead,
                                nccl_matching=True)
            trainer = assemble(cfg, topo, board=board)
            log = trainer.p2p.record_posting()
            res = train(trainer)
            out[(schedule, lookahead)] = {
                "losses": res.losses, "grad_norms": res.grad_norms,
                "vpp": cfg.plan.parallelism.vpp, "schedule": trainer.schedule,
                "dp_rank": topo.dp_rank,
                "pp_rank": topo.pp_rank, "posted": {k: list(v) for k, v in log.items()},
                "params": {n: p.detach().clone() for n, p in trainer.named_parameters().items()},
            }
    finally:
        destroy_topology(topo)
    return out


@functools.lru_cache(maxsize=None)
def reference():
    losses, params, _ = reference_train(REF_CFG)
    return losses, params


@functools.lru_cache(maxsize=None)
def reference_norms() -> list[float]:
    return reference_run(REF_CFG).grad_norms


def runnable(pp: int, dp: int) -> list[str]:
    """The schedules with a microbatch count that splits the test's global batch at (pp, dp)
    (dualpipev needs m >= 2 pp: not at pp = 4, dp = 2)."""
    return [n for n in pipesim.schedule_names() if choose_microbatches(n, pp, dp) is not None]


def test_every_schedule_is_in_the_grid():
    for name in pipesim.schedule_names():
        layouts = [(pp, dp) for pp, dp in LAYOUTS if name in runnable(pp, dp)]
        assert len(layouts) >= 3 and {pp for pp, _ in layouts} == {2, 4}, (name, layouts)


@pytest.mark.parametrize("pp,dp", LAYOUTS, ids=[f"pp{p}-dp{d}" for p, d in LAYOUTS])
def test_nccl_matching_equals_single_process(pp, dp):
    cases = [(name, la) for name in runnable(pp, dp) for la in LOOKAHEADS]
    results = launch(matching_worker, pp * dp, (pp, dp, cases), timeout=600)
    ref_losses, ref_params = reference()
    for key in cases:
        label = f"{key[0]} pp={pp} dp={dp} vpp={results[0][key]['vpp']} lookahead={key[1]}"
        # what is really posted: per channel, sender's sequence == receiver's sequence
        by_rank = {(r[key]["dp_rank"], r[key]["pp_rank"]): r[key]["posted"] for r in results}
        for (d, p), posted in by_rank.items():
            for channel, seq in posted.items():
                kind, src, dst = channel
                other = by_rank[(d, dst if p == src else src)].get(channel)
                assert other == seq, (f"{label}: replica {d} channel {channel}: rank {src} posts "
                                      f"{seq if p == src else other}, rank {dst} "
                                      f"{other if p == src else seq}")
                assert len(seq) > 0
            # ... and a receiver posts each channel's data in the schedule's RECV order, every step
            sched = results[0][key]["schedule"]
            want: dict = {}
            for a in sched.actions(p):
                if a.op in ("RECV_F", "RECV_B"):
                    t = transfer_of(sched, p, a)
                    want.setdefault((0 if t.kind == "F" else 1, t.src, t.dst), []).append(
                        (t.boundary, t.microbatch))
            for channel, order in want.items():
                got = [(b, mb) for what, _, b, mb in posted[channel] if what == "data"]
                assert got == order * STEPS, f"{label}: rank {p} channel {channel}: posted {got}"
        losses = [r[key]["losses"] for r in results]
        assert all(ls == losses[0] for ls in losses), f"{label}: ranks disagree on the losses"
        torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(ref_losses), rtol=1e-5,
                                   atol=0, msg=lambda m: f"{label}: losses: {m}")
        for r in results:
            assert_grad_norms(r[key]["grad_norms"], reference_norms(), label)
        params = {}
        for r in results:
            if r[key]["dp_rank"] == 0:
                params.update(r[key]["params"])
        assert params.keys() == ref_params.keys(), label
        for n in ref_params:
            torch.testing.assert_close(params[n], ref_params[n], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{label}: {n}: {m}")


def test_nccl_matching_is_checked_before_start():
    with pytest.raises(ConfigError, match="nccl_matching emulates NCCL"):
        TINY.with_flat(pp=2, nccl_matching=True, device="cuda").validate()
    with pytest.raises(ConfigError, match="nccl_matching must be true or false"):
        TINY.with_flat(pp=2, nccl_matching="yes").validate()
