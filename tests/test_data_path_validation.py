"""Validation on ``--data-path`` reads the indexed datasets' validation split (``--split``'s
second share, Megatron's): batch ``i`` is validation samples ``i * global_batch ..``, never a
train sample; a pipelined run's validation loss is one process's, which is the mean loss of
those samples through the initial layers applied one after the other; an empty validation
split is refused before any process starts."""
from __future__ import annotations

import pytest
import torch

from checkpoint_helpers import TINY, fake_topology
from data_helpers import indexed_corpus
from pipeexec import launch
from pipeexec.config import ConfigError
from pipeexec.datasets import build_datasets
from pipeexec.run.worker import WorkerArgs, run_training
from pipeexec.models import layer_stack
from pipeexec.training.train import train
from pipeexec.run.assemble import assemble
from pipeexec.training.validation import EvalOptions, valid_batches


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    prefix, _ = indexed_corpus(tmp_path_factory.mktemp("vdata"))
    return str(prefix)


def config(prefix, **changes):
    return TINY.with_flat(**{**dict(layers=4, vocab=300, data_path=(prefix,), split="90,10,0",
                                  microbatches=4, micro_batch_size=2, steps=2), **changes})


def test_validation_batches_are_the_validation_split_s_samples(corpus):
    cfg = config(corpus)
    options = EvalOptions(eval_interval=1, eval_iters=2)
    train_ds, valid, _ = build_datasets(cfg, valid_samples=2 * cfg.global_batch)
    data = valid_batches(cfg, options)
    g = cfg.global_batch
    for i in range(2):
        rows = torch.cat([x for x, _ in data.microbatches(i, 0, 1, 4)])
        want = torch.stack([torch.as_tensor(valid[i * g + r][:-1]) for r in range(g)])
        assert torch.equal(rows, want)
    train_rows = {tuple(train_ds[k].tolist()) for k in range(len(train_ds))}
    assert not train_rows & {tuple(valid[k].tolist()) for k in range(2 * g)}


def test_one_process_validation_is_the_mean_loss_of_the_split_through_the_layers(corpus):
    cfg = config(corpus, pp=1)
    options = EvalOptions(eval_only=True, eval_iters=2)
    res = train(assemble(cfg, fake_topology()), evaluation=options)
    spec = layer_stack(cfg)
    layers = [spec.build_layer(i, cfg.runtime.seed) for i in range(spec.num_layers)]
    data, total = valid_batches(cfg, options), 0.0
    with torch.no_grad():
        for i in range(2):
            x, y = data.microbatches(i, 0, 1, 1)[0]
            for layer in layers:
                x = layer(x)
            total += spec.loss_fn(x, y).item()
    assert res.validation[0]["loss"] == pytest.approx(total / 2, rel=1e-6)


def _worker(board, cfg, options):
    return run_training(board, WorkerArgs(cfg, progress=False, evaluation=options)).metrics


def test_a_pipelined_run_validates_as_one_process_does(corpus):
    cfg = config(corpus, pp=2)
    options = EvalOptions(eval_interval=1, eval_iters=2)
    got = launch(_worker, 2, (cfg, options), timeout=240)
    ref = train(assemble(cfg.with_flat(pp=1), fake_topology()), evaluation=options)
    losses = [v["loss"] for v in got[-1]["validation"]]
    assert losses == pytest.approx([v["loss"] for v in ref.validation], rel=1e-5)


def test_an_empty_validation_split_is_refused_naming_the_split(corpus):
    with pytest.raises(ConfigError, match=r"--eval-interval evaluates on the validation split"):
        EvalOptions(eval_interval=1).validate(config(corpus, split="100,0,0"))
    with pytest.raises(ConfigError, match="--data-path validates on its own validation split"):
        EvalOptions(eval_interval=1, valid_data="x.txt").validate(config(corpus))


def status(main, argv) -> int:
    """The CLI's exit status, whether it returns it or exits with it."""
    try:
        return main(argv) or 0
    except SystemExit as exc:
        return int(exc.code or 0)


def test_an_export_of_a_tokenized_run_carries_its_tokenizer(corpus, tmp_path):
    """The run records its --tokenizer folder; export-hf copies it beside the weights, so
    transformers loads the model and the tokenizer from one folder."""
    transformers = pytest.importorskip("transformers")
    from pathlib import Path

    from pipeexec.cli.main import main

    tok = str(Path(corpus).parent / "tok")
    args = ["train", "--data-path", corpus, "--tokenizer", tok, "--vocab", "300", "--layers", "2",
            "--hidden", "16", "--heads", "2", "--seq-len", "8", "--microbatches", "1",
            "--steps", "1", "--no-progress", "--save", str(tmp_path / "ck")]
    assert status(main, args) == 0
    assert status(main, ["checkpoint", "export-hf", str(tmp_path / "ck"), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    ours = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    theirs = transformers.AutoTokenizer.from_pretrained(tok, local_files_only=True)
    assert ours("the quick fox")["input_ids"] == theirs("the quick fox")["input_ids"]
