"""Validation (``--eval-interval``, ``--eval-iters``, ``--eval-only``, ``--valid-data``), the
metrics written to TensorBoard / W&B, and the progress bar.

The validation loss of a pipelined or data-parallel run is one process's (the same run at
pp 1, dp 1, trained in this process), and one process's validation loss before training is
the mean cross-entropy of the held-out batches through the model's layers applied one after
the other (plain torch, no runtime). TensorBoard's scalars are read back with TensorBoard's
own ``EventAccumulator``.
"""
from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
import torch

from checkpoint_helpers import fake_topology
from pipeexec import launch
from pipeexec.checkpoint import CheckpointOptions
from pipeexec.cli.main import main as cli_main
from pipeexec.config import ConfigError, TrainConfig
from pipeexec.run.worker import WorkerArgs, run_training
from pipeexec.models import layer_stack
from pipeexec.training.metrics_log import LogOptions
from pipeexec.training.train import train
from pipeexec.run.assemble import assemble
from pipeexec.training.validation import EvalOptions, valid_batches

TINY = TrainConfig.from_flat(layers=4, hidden=16, heads=2, seq_len=8, vocab=32, steps=2, lr=1e-2,
                             microbatches=4, micro_batch_size=2, seed=5, device="cpu",
                             p2p_timeout=60.0, collective_timeout=120.0)
EVAL = EvalOptions(eval_interval=1, eval_iters=2)


def direct_valid_loss(cfg: TrainConfig, options: EvalOptions) -> float:
    """The mean loss of the validation batches through the initial layers, one after the
    other in this process (no schedule, no runtime)."""
    spec = layer_stack(cfg)
    layers = [spec.build_layer(i, cfg.runtime.seed) for i in range(spec.num_layers)]
    data = valid_batches(cfg, options)
    total = 0.0
    with torch.no_grad():
        for i in range(options.eval_iters):
            x, y = data.microbatches(i, 0, 1, 1)[0]
            for layer in layers:
                x = layer(x)
            total += spec.loss_fn(x, y).item()
    return total / options.eval_iters


def one_process(cfg: TrainConfig, options: EvalOptions, **kwargs):
    """The run at pp 1, dp 1 (the same global batch), trained in this process."""
    ref = cfg.with_flat(pp=1, vpp=1, dp=1, tp=1, cp=1, ep=1, zero=0, schedule="1f1b",
                        sequence_parallel=False,
                        microbatches=cfg.plan.microbatches * cfg.plan.parallelism.dp)
    return train(assemble(ref, fake_topology()), evaluation=options, **kwargs)


def test_one_process_validation_is_the_mean_loss_of_the_held_out_batches():
    res = one_process(TINY, EvalOptions(eval_only=True, eval_iters=3))
    assert res.losses == [] and [v["iteration"] for v in res.validation] == [0]
    assert res.validation[0]["loss"] == pytest.approx(
        direct_valid_loss(TINY, EvalOptions(eval_only=True, eval_iters=3)), rel=1e-6)


def test_synthetic_validation_batches_are_no_training_batches():
    src = valid_batches(TINY, EVAL)
    trainer_batches = {tuple(TINY_batch.flatten().tolist())
                       for k in range(50) for TINY_batch, _ in
                       assemble(TINY, fake_topology()).data.microbatches(k, 0, 1, 4)}
    held_out = [tuple(x.flatten().tolist()) for i in range(10)
                for x, _ in src.microbatches(i, 0, 1, 4)]
    assert not trainer_batches & set(held_out)
    # the same batches at every evaluation
    again = [tuple(x.flatten().tolist()) for i in range(10)
             for x, _ in src.microbatches(i, 0, 1, 4)]
    assert held_out == again


def test_text_validation_reads_the_held_out_file(tmp_path):
    train_file, valid_file = tmp_path / "train.txt", tmp_path / "valid.txt"
    train_file.write_bytes(bytes(range(256)) * 4)
    valid_file.write_bytes(b"the held-out text, a little of it, " * 8)
    cfg = TINY.with_flat(data=str(train_file), vocab=256)
    options = EvalOptions(eval_only=True, eval_iters=2, valid_data=str(valid_file)).validate(cfg)
    x, _ = valid_batches(cfg, options).microbatches(0, 0, 1, 1)[0]
    assert set(x.flatten().tolist()) <= set(valid_file.read_bytes())
    res = one_process(cfg, options)
    assert res.validation[0]["loss"] == pytest.approx(direct_valid_loss(cfg, options), rel=1e-6)


@pytest.mark.parametrize("layout", [
    dict(pp=2, vpp=2, schedule="interleaved"),
    dict(dp=2, zero=3, microbatches=2),
])
def test_validation_of_two_ranks_is_one_process_s(layout):
    cfg = TINY.with_flat(**layout)
    results = launch(run_training, 2, (WorkerArgs(cfg, progress=False, evaluation=EVAL),),
                     timeout=240)
    ref = one_process(cfg, EVAL)
    for r in results:           # every rank has the all-reduced value
        got = r.metrics["validation"]
        assert [v["iteration"] for v in got] == [1, 2]
        assert [v["loss"] for v in got] == pytest.approx([v["loss"] for v in ref.validation],
                                                         rel=1e-5)
    assert results[0].metrics["losses"] == pytest.approx(ref.losses, rel=1e-5)


MIXTRAL = dict(model_type="mixtral", hidden_size=16, intermediate_size=24, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=2, vocab_size=32,
               max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2)


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(tp=2, sequence_parallel=True), dict(cp=2),
                                    dict(dp=2, ep=2, microbatches=2, hf="mixtral")])
def test_validation_under_tensor_context_and_expert_parallelism_is_one_process_s(layout,
                                                                               tmp_path):
    cfg = TINY.with_flat(**{k: v for k, v in layout.items() if k != "hf"})
    if layout.get("hf"):
        pytest.importorskip("transformers")
        import json
        (tmp_path / "config.json").write_text(json.dumps(MIXTRAL))
        cfg = cfg.with_hf_model(str(tmp_path))
    results = launch(run_training, 2, (WorkerArgs(cfg, progress=False, evaluation=EVAL),),
                     timeout=240)
    ref = one_process(cfg, EVAL)
    assert [v["loss"] for v in results[0].metrics["validation"]] == pytest.approx(
        [v["loss"] for v in ref.validation], rel=1e-5)


def test_eval_only_evaluates_the_loaded_checkpoint(tmp_path):
    cfg = TINY.with_flat(pp=2)
    trained = launch(run_training, 2, (WorkerArgs(
        cfg, progress=False, evaluation=EvalOptions(eval_interval=2, eval_iters=2),
        checkpoint=CheckpointOptions(save=str(tmp_path / "ckpt"))),), timeout=240)
    end = trained[0].metrics["validation"][-1]
    assert end["iteration"] == 2
    evaluated = launch(run_training, 2, (WorkerArgs(
        cfg, progress=False, evaluation=EvalOptions(eval_only=True, eval_iters=2),
        checkpoint=CheckpointOptions(load=str(tmp_path / "ckpt"))),), timeout=240)
    m = evaluated[0].metrics
    assert m["losses"] == [] and m["validation"][0]["iteration"] == 2
    assert m["validation"][0]["loss"] == end["loss"]       # the same weights, the same batches
    assert m["checkpoint"]["save_times"] == [] and m["checkpoint"]["loaded_iteration"] == 2


def cli_status(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exc:
        cli_main(["train", *argv])
    return exc.value.code


@pytest.mark.parametrize("argv,message", [
    (["--eval-interval", "0"], "--eval-interval must be a positive integer"),
    (["--eval-interval", "2", "--eval-iters", "-1"], "--eval-iters must be a positive integer"),
    (["--valid-data", "x.txt"], "--valid-data is read by validation"),
    (["--eval-only", "--valid-data", "x.txt"], "synthetic data validates on a stream"),
    (["--eval-only", "--forward-only"], "drop --forward-only"),
    (["--log-interval", "0"], "--log-interval must be a positive integer"),
    (["--wandb-dir", "w"], "--wandb-dir needs --wandb-project"),
    (["--eval-only", "--profile", "0:1"], "--eval-only trains no step for --profile"),
])
def test_bad_flags_are_refused_before_any_process_starts(argv, message, capsys):
    assert cli_status(["--steps", "1", *argv]) == 2
    assert message in capsys.readouterr().err


def test_text_validation_without_a_held_out_file_is_refused(tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_bytes(b"x" * 100)
    assert cli_status(["--data", str(text), "--eval-interval", "1"]) == 2
    assert "needs a held-out text file: give --valid-data FILE" in capsys.readouterr().err
    assert cli_status(["--data", str(text), "--eval-interval", "1", "--valid-data",
                       str(tmp_path / "none.txt")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_missing_packages_are_named_before_any_process_starts(monkeypatch, capsys):
    import sys
    monkeypatch.setitem(sys.modules, "tensorboard", None)     # find_spec: not installed
    monkeypatch.setitem(sys.modules, "wandb", None)
    assert cli_status(["--tensorboard-dir", "tb"]) == 2
    assert "needs the tensorboard package" in capsys.readouterr().err
    assert cli_status(["--wandb-project", "p"]) == 2
    assert "needs the wandb package: pip install wandb" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="tensorboard"):
        LogOptions(tensorboard_dir="tb").validate()


def read_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_scalars_are_the_runs_metrics(tmp_path):
    pytest.importorskip("tensorboard")
    cfg = TINY.with_flat(pp=2, steps=3)
    tb = tmp_path / "tb"
    results = launch(run_training, 2, (WorkerArgs(
        cfg, progress=False, evaluation=EvalOptions(eval_interval=2, eval_iters=1),
        logging=LogOptions(tensorboard_dir=str(tb))),), timeout=240)
    assert len(list(tb.glob("events.out.tfevents.*"))) == 1      # one writer: the last stage
    m = results[1].metrics          # the writer's: rank 1 holds the last stage
    s = read_scalars(tb)

    def f32(xs):        # TensorBoard stores float32
        return pytest.approx([float(torch.tensor(x, dtype=torch.float32)) for x in xs])
    assert [k for k, _ in s["train/loss"]] == [1, 2, 3]
    assert [v for _, v in s["train/loss"]] == f32(m["losses"])
    assert [v for _, v in s["train/lr"]] == f32(m["lrs"])
    assert [v for _, v in s["train/grad_norm"]] == f32(m["grad_norms"])
    assert [v for _, v in s["train/step_time_s"]] == f32(m["step_times"])
    assert [v for _, v in s["train/tokens_per_s"]] == f32(m["tokens_per_s"])
    assert [v for _, v in s["train/skipped_steps"]] == [0, 0, 0]
    assert [k for k, _ in s["valid/loss"]] == [2, 3]
    assert [v for _, v in s["valid/loss"]] == f32([v["loss"] for v in m["validation"]])
    assert [v for _, v in s["valid/ppl"]] == f32([math.exp(v["loss"]) for v in m["validation"]])
    # MFU: pipesim's model FLOPs of the step over time x world size x the plan's peak
    from pipesim.plan.flops import model_flops
    flops = model_flops(cfg.plan.model, cfg.global_batch, causal=True)
    peak = cfg.plan.cluster.hardware.peak_flops
    assert [v for _, v in s["train/mfu"]] == f32([flops / (t * 2 * peak) for t in m["step_times"]])
    assert all(v > 0 for _, v in s["train/max_rss_bytes"])     # CPU: the writer's peak RSS


def test_log_interval_thins_the_lines_and_the_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    lines: list[str] = []
    cfg = TINY.with_flat(steps=5)
    train(assemble(cfg, fake_topology()), log=lines.append,
          logging=LogOptions(log_interval=2, tensorboard_dir=str(tmp_path)))
    assert [line.split(" (")[0] for line in lines] == ["step 1", "step 3", "step 4"]
    assert [k for k, _ in read_scalars(tmp_path)["train/loss"]] == [2, 4, 5]


@pytest.mark.slow
def test_wandb_offline_run_is_written(tmp_path):
    """In a process of its own: wandb leaves threads behind, and a later fork is refused."""
    pytest.importorskip("wandb")
    import os
    import subprocess
    import sys
    code = (
        "import sys\n"
        "sys.path.insert(0, 'tests')\n"
        "from checkpoint_helpers import fake_topology\n"
        "from pipeexec.config import TrainConfig\n"
        "from pipeexec.training.metrics_log import LogOptions\n"
        "from pipeexec.run.assemble import assemble\n"
        "from pipeexec.training.train import train\n"
        "from pipeexec.training.validation import EvalOptions\n"
        "cfg = TrainConfig.from_flat(layers=2, hidden=16, heads=2, seq_len=8, vocab=32, steps=2, "
        "device='cpu')\n"
        "res = train(assemble(cfg, fake_topology()), evaluation=EvalOptions(eval_interval=1), "
        f"logging=LogOptions(wandb_project='pipeexec-test', wandb_dir={str(tmp_path)!r}))\n"
        "print('validated', len(res.validation))\n")
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", PYTHONPATH=str(root),
               OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "validated 2" in out.stdout
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_progress_bar_with_eta_and_no_step_lines(monkeypatch):
    screen = _Terminal()
    monkeypatch.setattr("sys.stdout", screen)
    lines: list[str] = []
    train(assemble(TINY.with_flat(steps=3), fake_topology()), log=lines.append, progress=True,
          evaluation=EvalOptions(eval_interval=3))
    out = screen.getvalue()
    assert "3/3" in out and "<00:00" in out and "loss" in out        # count, ETA, postfix
    assert lines == []                      # the bar, not step lines; validation via the bar
    assert "validation iteration 3 loss" in out


def test_without_a_terminal_each_step_has_its_line(monkeypatch):
    monkeypatch.setattr("sys.stdout", io.StringIO())
    lines: list[str] = []
    train(assemble(TINY.with_flat(steps=2), fake_topology()), log=lines.append, progress=True,
          evaluation=EVAL)
    assert [line.split(" loss")[0] for line in lines] == [
        "step 0 (1 of 2)", "validation iteration 1", "step 1 (2 of 2)", "validation iteration 2"]
