"""Checkpointing across real processes (forked gloo ranks on CPU).

* Exact resume: 2 iterations, stop, load, 2 more == 4 in one go, bitwise (losses and every
  parameter of both data-parallel replicas), with pp=2 dp=2.
* Resharding, continuing the same run: the pp=2 dp=2 1F1B checkpoint loads directly into
  pp=4 dp=1 interleaved vpp=2 (pp 2->4, dp 2->1, vpp 1->2, schedule change); that run's
  checkpoint is converted offline (`convert_checkpoint`) to pp=2 vpp=1 GPipe (pp 4->2,
  vpp 2->1) and loaded as is. Losses and parameters follow the uninterrupted run within fp32
  tolerance (the reduction order changes with the layout, so not bitwise).
* A rank SIGKILLed in the middle of a save (its temporary file written, not renamed) through
  the CLI (its entry point, run in the test's process: `cli_helpers.run_pipeexec`): the run
  fails naming the rank, the tracker still names the previous checkpoint, and a resumed run
  reproduces the uninterrupted run's losses bitwise. A corrupt file then fails the CLI with
  the file named.
"""
from __future__ import annotations

import functools
import json

import pytest
import torch

from checkpoint_helpers import TINY, checkpoint_worker, flip_bit, merge_params
from cli_helpers import run_pipeexec
from pipeexec import launch
from pipeexec.cli.train import config_from_args
from pipeexec.cli.main import _parser
from pipeexec.cli.main import main as cli_main
from pipeexec.checkpoint import (FAULT_ENV, CheckpointOptions, convert_checkpoint, describe,
                                 read_tracker, state_file, tracker_path)

pytestmark = pytest.mark.slow

BASE = TINY.with_flat(schedule="1f1b", pp=2, dp=2, microbatches=2, micro_batch_size=4)   # batch 16
PP4 = TINY.with_flat(schedule="interleaved", pp=4, vpp=2, dp=1, microbatches=4, micro_batch_size=4)
PP2 = TINY.with_flat(schedule="gpipe", pp=2, vpp=1, dp=1, microbatches=4, micro_batch_size=4)


def run(cfg, options=CheckpointOptions(), snapshot_at=()):
    return launch(checkpoint_worker, cfg.world_size, (cfg, options, snapshot_at), timeout=300)


@functools.lru_cache(maxsize=None)
def uninterrupted():
    res = run(BASE.with_flat(steps=8), snapshot_at=(4, 6))
    return res[0]["losses"], {it: merge_params(res, it) for it in (4, 6, 8)}, res


def close(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=1e-5, atol=1e-6, msg=n)


def test_exact_resume_then_reshard(tmp_path):
    losses, params, full = uninterrupted()
    a, c, d = tmp_path / "a", tmp_path / "c", tmp_path / "d"
    # the two replicas of the uninterrupted run agree (so comparing replica 0 is enough below)
    assert all(torch.equal(v, merge_params(full, 8, 1)[n]) for n, v in params[8].items())

    first = run(BASE.with_flat(steps=2), CheckpointOptions(save=str(a)))
    assert first[0]["losses"] == losses[:2] and read_tracker(a) == 2
    f = torch.load(state_file(a, 2, 1), weights_only=True)
    assert len(f["rng_state"]) == 2 and f["layout"]["dp"] == 2     # both replicas' RNG states

    second = run(BASE.with_flat(steps=4),
                 CheckpointOptions(save=str(a), load=str(a), save_interval=2))
    assert second[0]["start"] == 2 and second[0]["losses"] == losses[2:4]      # bitwise
    for dp_rank in (0, 1):
        got = merge_params(second, 4, dp_rank)
        assert all(torch.equal(got[n], v) for n, v in params[4].items())
    assert read_tracker(a) == 4

    third = run(PP4.with_flat(steps=6), CheckpointOptions(save=str(c), load=str(a)))
    assert third[0]["loaded"]["resharded"] and third[0]["start"] == 4
    assert third[0]["loaded"]["iteration"] == 4
    torch.testing.assert_close(third[0]["losses"], losses[4:6], rtol=1e-5, atol=0)
    close(merge_params(third, 6), params[6])

    convert_checkpoint(c, d, pp=2, vpp=1, schedule="gpipe")
    fourth = run(PP2.with_flat(steps=8), CheckpointOptions(load=str(d)))
    assert not fourth[0]["loaded"]["resharded"] and fourth[0]["start"] == 6
    torch.testing.assert_close(fourth[0]["losses"], losses[6:8], rtol=1e-5, atol=0)
    close(merge_params(fourth, 8), params[8])


def test_dualpipe_saves_each_tied_parameter_once_and_resumes_in_any_layout(tmp_path):
    """dualpipe holds every model part twice (a part and its tied copy on another rank): its
    checkpoint holds each parameter once (the part's first stage saves it), so it is the
    model's checkpoint: it resumes as dualpipe and as 1F1B, both following the uninterrupted
    run (1F1B, same batch) within fp32 tolerance."""
    dual = TINY.with_flat(schedule="dualpipe", pp=2, vpp=1, dp=1, microbatches=4,
                          micro_batch_size=4)
    one = dual.with_flat(schedule="1f1b")
    full = run(one.with_flat(steps=4), snapshot_at=(2,))
    losses, params = full[0]["losses"], merge_params(full, 4)
    a = tmp_path / "a"
    first = run(dual.with_flat(steps=2), CheckpointOptions(save=str(a)))
    torch.testing.assert_close(first[0]["losses"], losses[:2], rtol=1e-5, atol=0)
    files = [torch.load(state_file(a, 2, r), weights_only=True) for r in range(2)]
    names = [set(f["model"]) for f in files]
    assert not names[0] & names[1] and names[0] | names[1] == set(params)
    assert [set(f["optimizer"]["state"]) for f in files] == names
    assert [f["layout"]["stages"] for f in files] == [[0], [1]]
    for cfg in (dual, one):
        res = run(cfg.with_flat(steps=4), CheckpointOptions(load=str(a)))
        assert res[0]["start"] == 2, cfg.plan.schedule_name
        torch.testing.assert_close(res[0]["losses"], losses[2:4], rtol=1e-5, atol=0)
        close(merge_params(res, 4), params)


def _cli(args, capfd, monkeypatch, fault=None):
    """``pipeexec train ARGS`` in this process (`cli_helpers.run_pipeexec`), its ranks told
    ``fault`` (`FAULT_ENV`) when given."""
    with monkeypatch.context() as env:
        if fault:
            env.setenv(FAULT_ENV, fault)
        else:
            env.delenv(FAULT_ENV, raising=False)
        return run_pipeexec(["train", *args], capfd)


def test_sigkill_mid_save_then_resume(tmp_path, capfd, monkeypatch):
    common = ["--pp", "2", "--schedule", "1f1b", "--microbatches", "2", "--micro-batch-size", "2",
              "--layers", "2", "--hidden", "16", "--heads", "2", "--seq-len", "8", "--vocab", "32",
              "--steps", "4", "--warmup-steps", "1", "--decay-steps", "4", "--seed", "5",
              "--no-progress", "--timeout", "200"]
    d = tmp_path / "ckpt"
    # the uninterrupted run, in-process with the config the CLI builds from the same flags
    cfg = config_from_args(_parser().parse_args(["train", *common]))
    ref_losses = run(cfg)[0]["losses"]

    killed = _cli(common + ["--save", str(d), "--save-interval", "2"], capfd, monkeypatch,
                  fault="kill:1:4:before-rename")
    assert killed.returncode != 0
    assert "rank 1 was killed by signal SIGKILL" in killed.stderr, killed.stderr
    assert "step 3 (4 of 4)" in killed.stdout           # it died in the save after step 3
    assert read_tracker(d) == 2
    rank1_dir = state_file(d, 4, 1).parent
    assert not state_file(d, 4, 1).exists()
    assert [p.name.startswith(".model_optim_rng.pt.tmp-") for p in rank1_dir.iterdir()] == [True]
    text = describe(d)
    assert "iter_0000002: 2 rank file(s)  <- latest" in text
    assert "iter_0000004: INCOMPLETE" in text and "pipeline rank 1 is missing" in text

    resumed = _cli(common + ["--save", str(d), "--save-interval", "2", "--load", str(d),
                             "--metrics-out", str(tmp_path / "res.json")], capfd, monkeypatch)
    assert resumed.returncode == 0, resumed.stderr
    assert "checkpoint: loaded iter_0000002" in resumed.stdout
    metrics = json.loads((tmp_path / "res.json").read_text())
    assert metrics["losses"] == ref_losses[2:]          # --steps counts total iterations; bitwise
    assert metrics["checkpoint"]["loaded_iteration"] == 2 and len(metrics["checkpoint"]["save_times"]) == 1
    assert read_tracker(d) == 4 and list(rank1_dir.iterdir()) == [state_file(d, 4, 1)]

    # a corrupt file: non-zero exit, the file and the bad record named, no training
    path = state_file(d, 4, 1)
    record = flip_bit(path, "data.pkl")     # rank 0 reads this record too (the save's id)
    capfd.readouterr()
    with pytest.raises(SystemExit) as exit_:
        cli_main(["train", *common, "--load", str(d), "--steps", "6"])
    assert exit_.value.code == 1
    err = capfd.readouterr().err
    # whichever rank reports first, the file and its record are named as failing the CRC
    assert str(path) in err and "CRC-32" in err and "CheckpointError" in err, err
    assert record in err, err
    assert tracker_path(d).read_text() == "4\n"
