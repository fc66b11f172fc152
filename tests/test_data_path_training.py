"""Training on ``--data-path`` (pipeexec/data.py's `IndexedBatches`): step ``k`` trains on
train samples ``k * global_batch ..`` whatever the layout (each replica reads its own rows), so
a run resumed from a checkpoint, in the same or another layout, sees exactly the samples an
uninterrupted run sees. The reference is one process trained in this process; the resumed
runs are forked ranks (2 here, tp 2 x pp 2 -> pp 4 x dp 2 through the CLI in the slow test);
context-parallel ranks of one replica share its samples."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from checkpoint_helpers import TINY, checkpoint_worker, fake_topology
from cli_helpers import run_pipeexec
from data_helpers import make_corpus, make_tokenizer
from pipeexec import launch
from pipeexec.checkpoint import CheckpointOptions
from pipeexec.config import ConfigError
from pipeexec.data import DataError, IndexedBatches, batch_source
from pipeexec.datasets import build_datasets
from pipeexec.datasets.preprocess import PreprocessOptions, preprocess
from pipeexec.training.train import train
from pipeexec.run.assemble import assemble


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    text = make_corpus(d, documents=120)
    tok = make_tokenizer(d / "tok", text, 300)
    preprocess(PreprocessOptions(input=str(text), tokenizer=str(tok),
                                 output_prefix=str(d / "c"), progress=False))
    return {"prefix": str(d / "c"), "tokenizer": str(tok), "text": str(text), "dir": d}


def config(corpus, **changes):
    fields = dict(layers=4, vocab=300, data_path=(corpus["prefix"],), split="98,2,0",
                  tokenizer=corpus["tokenizer"])
    return TINY.with_flat(**{**fields, **changes})


def test_each_replica_reads_its_rows_of_the_global_batch(corpus):
    cfg = config(corpus, pp=1, dp=2, microbatches=2, micro_batch_size=3, steps=5)
    train_ds, valid, test = build_datasets(cfg)
    src = batch_source(cfg)
    g = cfg.global_batch                              # 12
    assert isinstance(src, IndexedBatches) and len(train_ds) >= 5 * g and len(valid) > 0
    assert len(test) == 0                             # its share is 0
    from pipeexec.datasets import build_dataset

    alone = build_dataset(cfg, "validation")
    assert [alone[i].tolist() for i in range(len(alone))] == [valid[i].tolist()
                                                             for i in range(len(valid))]
    for step in (0, 3):
        want = np.stack([train_ds[step * g + r] for r in range(g)])
        x, y = src.global_batch_at(step)
        assert x.tolist() == want[:, :-1].tolist() and y.tolist() == want[:, 1:].tolist()
        rows = [mb for d in range(2) for mb in src.microbatches(step, d, 2, 2)]
        assert torch.cat([mb[0] for mb in rows]).tolist() == want[:, :-1].tolist()
    past = len(train_ds) // g          # whole epochs: a few steps more than asked for
    with pytest.raises(DataError, match=rf"step {past} needs train samples up to"):
        src.global_batch_at(past)
    small = IndexedBatches(train_ds, seq_len=cfg.plan.model.seq_length, vocab=100, global_batch=g)
    with pytest.raises(DataError, match=r"hold token id \d+, the model's vocabulary is 100"):
        small.global_batch_at(0)


def test_bad_data_paths_are_refused_before_any_process(corpus, tmp_path):
    from pipeexec.config import TrainConfig

    cfg = config(corpus)
    cfg.validate()
    # as checkpoints and measured runs store it (JSON: the items come back as a list)
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    for changes, why in (({"data_path": ("nope",)}, r"nope\.idx: no such index"),
                         ({"data_path": ("1", corpus["prefix"], "x")}, "mixing numbers"),
                         ({"data_path": ("0", corpus["prefix"])}, "every weight is 0"),
                         ({"split": "a,b"}, r"--split 'a,b': 'a' is not a number"),
                         ({"split": "0,0"}, "sum to 0"),
                         ({"data": corpus["text"]}, "not both"),
                         ({"split": "0,1,0"}, "train split .* holds 0 tokens")):
        with pytest.raises(ConfigError, match=why):
            cfg.with_flat(**changes).validate()


def test_a_text_file_with_a_tokenizer_trains_on_its_tokens(corpus):
    from transformers import AutoTokenizer

    cfg = TINY.with_flat(layers=4, vocab=300, data=corpus["text"], tokenizer=corpus["tokenizer"])
    src = batch_source(cfg)
    ids = AutoTokenizer.from_pretrained(corpus["tokenizer"], local_files_only=True).encode(
        Path(corpus["text"]).read_text(), add_special_tokens=False)
    x, y = src.global_batch_at(0)
    stream = " ".join(map(str, ids))
    for row in torch.cat([x, y[:, -1:]], dim=1).tolist():     # each row a window of the tokens
        assert " ".join(map(str, row)) in stream
    assert int(x.max()) > 255                         # tokens, not bytes


def _reference(cfg, steps):
    trainer = assemble(cfg.with_flat(pp=1, dp=1, tp=1, vpp=1, schedule="1f1b"), fake_topology())
    return train(trainer).losses[:steps]


def test_resume_into_another_layout_sees_the_uninterrupted_samples(corpus, tmp_path):
    """pp 2 for 2 steps, saved; resumed at dp 2 for 2 more: the losses are the one-process
    run's (fp32, rtol 1e-5: the layouts reduce in other orders)."""
    base = config(corpus, steps=4, decay_steps=4, microbatches=2, micro_batch_size=4)
    ref = _reference(base, 4)
    first = base.with_flat(pp=2, dp=1, steps=2)
    a = launch(checkpoint_worker, 2, (first, CheckpointOptions(save=str(tmp_path / "a"))),
               timeout=300)
    torch.testing.assert_close(a[0]["losses"], ref[:2], rtol=1e-5, atol=0)
    second = base.with_flat(pp=1, dp=2, micro_batch_size=2)             # the same global batch
    b = launch(checkpoint_worker, 2, (second, CheckpointOptions(load=str(tmp_path / "a"))),
               timeout=300)
    assert b[0]["start"] == 2
    torch.testing.assert_close(b[0]["losses"], ref[2:], rtol=1e-5, atol=0)


@pytest.mark.slow
def test_cli_resume_from_tp2_pp2_into_pp4_dp2(corpus, tmp_path, capfd):
    """Through the CLI: tp 2 x pp 2 (4 ranks) trains 2 of 4 steps and saves; pp 4 x dp 2 (8
    ranks) resumes and trains the last 2; every loss is the one-process run's (the command
    run in this process: `cli_helpers.run_pipeexec`)."""
    base = config(corpus, steps=4, decay_steps=4, microbatches=4, micro_batch_size=2)
    ref = _reference(base, 4)
    common = ["--data-path", corpus["prefix"], "--split", "98,2,0", "--tokenizer",
              corpus["tokenizer"], "--layers", "4", "--hidden", "16", "--heads", "2",
              "--seq-len", "8", "--vocab", "300", "--lr", "3e-3", "--min-lr", "3e-4",
              "--warmup-steps", "1", "--weight-decay", "0.1", "--clip-grad", "0.5",
              "--seed", "11", "--decay-steps", "4", "--microbatches", "4", "--no-progress",
              "--device", "cpu"]
    runs = [(["--tp", "2", "--pp", "2", "--micro-batch-size", "2", "--steps", "2", "--save",
              str(tmp_path / "ck")], ref[:2]),
            (["--pp", "4", "--dp", "2", "--micro-batch-size", "1", "--steps", "4", "--load",
              str(tmp_path / "ck")], ref[2:])]
    for k, (args, want) in enumerate(runs):
        out = tmp_path / f"m{k}.json"
        p = run_pipeexec(["train", *common, *args, "--metrics-out", str(out)], capfd)
        assert p.returncode == 0, p.stdout + p.stderr
        torch.testing.assert_close(json.loads(out.read_text())["losses"], want, rtol=1e-5,
                                   atol=0)


def test_a_tokenizer_larger_than_the_model_is_refused_before_any_process(corpus, capsys):
    from pipeexec.cli.main import main

    with pytest.raises(SystemExit) as exc:
        main(["train", "--data-path", corpus["prefix"], "--tokenizer", corpus["tokenizer"],
              "--vocab", "256", "--no-progress"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert (f"--tokenizer {corpus['tokenizer']} has a vocabulary of 300 ids, the model's is "
            "256 (--vocab)") in err and "rank" not in err
    with pytest.raises(SystemExit) as exc:
        main(["train", "--data", corpus["text"], "--tokenizer", str(corpus["dir"] / "none"),
              "--vocab", "300", "--no-progress"])
    assert exc.value.code == 2 and "no such folder" in capsys.readouterr().err


def test_a_resume_that_would_draw_other_samples_is_warned_of(corpus):
    from pipeexec.datasets.build import train_order
    from pipeexec.run.preflight import data_change_warning

    cfg = config(corpus, steps=4, decay_steps=None)
    saved = cfg.to_dict()
    assert data_change_warning(cfg, saved) is None
    assert data_change_warning(cfg.with_flat(steps=6), saved) is None      # still one epoch
    assert "--split '98,2,0' -> '90,10,0'" in data_change_warning(cfg.with_flat(split="90,10,0"),
                                                                   saved)
    assert "--seed 11 -> 12" in data_change_warning(cfg.with_flat(seed=12), saved)
    # enough steps for a second epoch: the shuffle of the whole split changes
    epoch = len(build_datasets(cfg)[0]) // cfg.global_batch + 1
    longer = cfg.with_flat(steps=epoch)
    assert train_order(cfg) == ((1, False),) and train_order(longer)[0][0] == 2
    assert "the number of epochs" in data_change_warning(longer, saved)
    assert data_change_warning(longer, longer.to_dict()) is None


def test_a_run_that_evaluates_needs_a_validation_split(corpus):
    from pipeexec.training.validation import EvalOptions

    cfg = config(corpus, split="100,0,0")
    cfg.validate()                                   # no evaluation: an empty split is fine
    with pytest.raises(ConfigError, match=r"--eval-interval evaluates on the validation split, "
                       r"which is empty for .* \(--split 100,0,0: its share is 0\)"):
        EvalOptions(eval_interval=5).validate(cfg)
    EvalOptions(eval_interval=5).validate(config(corpus, split="98,2,0"))


def test_a_corpus_of_wider_ids_than_the_vocabulary_is_warned_of(corpus, tmp_path):
    from pipeexec.datasets.indexed import IndexedDatasetWriter
    from pipeexec.run.preflight import token_dtype_warning

    assert token_dtype_warning(config(corpus)) is None            # uint16 ids
    w = IndexedDatasetWriter(tmp_path / "wide", np.int32)
    w.add_document(np.arange(100))
    w.finish()
    wide = config(corpus, data_path=(str(tmp_path / "wide"),))
    assert "tokens stored as 32-bit ids" in token_dtype_warning(wide)
    assert "--vocab is 300" in token_dtype_warning(wide)
    assert token_dtype_warning(wide.with_flat(vocab=70000)) is None


def _cp_worker(board, cfg):
    from pipeexec.topology import destroy_topology, init_topology

    par = cfg.plan.parallelism
    topo = init_topology(par.pp, par.dp, cp=par.cp, timeout=120)
    try:
        return train(assemble(cfg, topo, board=board)).losses
    finally:
        destroy_topology(topo)


def test_context_parallel_ranks_share_the_replicas_samples(corpus):
    """cp 2: both ranks of the one replica train on halves of the same samples; the losses
    are the one-process run's."""
    cfg = config(corpus, steps=2, microbatches=2, micro_batch_size=2)
    ref = _reference(cfg, 2)
    got = launch(_cp_worker, 2, (cfg.with_flat(cp=2),), timeout=300)
    torch.testing.assert_close(got[0], ref, rtol=1e-5, atol=0)
