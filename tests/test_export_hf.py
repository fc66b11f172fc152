"""``pipeexec checkpoint export-hf``: a checkpoint of any layout written as a Hugging Face
model directory. The check is transformers' own: ``AutoModelForCausalLM.from_pretrained``
of the exported directory gives the logits of pipeexec's one-process forward of the
checkpoint (loaded by the checkpoint loader into a tp 1, pp 1 Trainer) on the same batch,
fp32, rtol 1e-5; and ``--hf-model OUT_DIR`` trains from those weights (its first loss is the
checkpoint's)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from checkpoint_helpers import fake_topology  # noqa: E402
from pipeexec import launch  # noqa: E402
from pipeexec.checkpoint import CheckpointError, CheckpointOptions, CheckpointReader  # noqa: E402
from pipeexec.checkpoint import load_checkpoint  # noqa: E402
from pipeexec.checkpoint.convert import config_from_dict  # noqa: E402
from pipeexec.checkpoint.export_hf import (INDEX_FILE, SINGLE_FILE, copy_tokenizer,  # noqa: E402
                                           export_hf, shard_plan)
from pipeexec.cli.main import main as cli_main  # noqa: E402
from pipeexec.config import TrainConfig  # noqa: E402
from pipeexec.run.assemble import assemble  # noqa: E402
from pipeexec.run.worker import WorkerArgs, run_training  # noqa: E402

_DECODER = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=64, max_position_embeddings=64,
                bos_token_id=1, eos_token_id=2)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)
FAMILIES = {
    "llama": dict(model_type="llama", **_DECODER),
    "mixtral": dict(model_type="mixtral", **_DECODER, num_local_experts=4,
                    num_experts_per_tok=2),
    "mistral": dict(model_type="mistral", **_DECODER, sliding_window=4),
    "qwen2": dict(model_type="qwen2", **_DECODER),
    "qwen2_moe": dict(model_type="qwen2_moe", **_DECODER, **_MOE,
                      shared_expert_intermediate_size=40, norm_topk_prob=True),
    "qwen3_moe": dict(model_type="qwen3_moe", **_DECODER, **_MOE, head_dim=16),
    "gpt2": dict(model_type="gpt2", n_embd=32, n_layer=2, n_head=4, vocab_size=64,
                 n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "llama-tied": dict(model_type="llama", **_DECODER, tie_word_embeddings=True),
}
BASE = dict(seq_len=8, steps=1, lr=1e-2, microbatches=2, micro_batch_size=2, seed=3,
            device="cpu", p2p_timeout=60.0, collective_timeout=120.0)


def model_dir(root: Path, family: str) -> str:
    d = root / f"hf-{family}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(FAMILIES[family]))
    return str(d)


def train_and_save(cfg: TrainConfig, save: Path) -> None:
    """Train ``cfg`` (its world size in forked ranks) one step and save a checkpoint."""
    launch(run_training, cfg.world_size,
           (WorkerArgs(cfg, progress=False, checkpoint=CheckpointOptions(save=str(save))),),
           timeout=240)


def one_process_config(ckpt: Path) -> TrainConfig:
    """The checkpoint's run at tp 1, pp 1, dp 1, one microbatch of its global batch."""
    cfg, _ = config_from_dict(CheckpointReader(ckpt).config)
    return cfg.with_flat(tp=1, pp=1, dp=1, ep=1, cp=1, zero=0, vpp=1, schedule="1f1b",
                         sequence_parallel=False, boundaries=None, microbatches=1,
                         micro_batch_size=cfg.global_batch)


def one_process_logits(ckpt: Path) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(tokens, logits, loss) of pipeexec's own forward of the checkpoint in one process:
    the checkpoint loaded into a tp 1, pp 1, dp 1 Trainer, the batch of step 0."""
    trainer = assemble(one_process_config(ckpt), fake_topology())
    load_checkpoint(trainer, ckpt, finetune=True)
    out = trainer.forward(0, keep_outputs=True)
    tokens, _ = trainer.data.microbatches(0, 0, 1, 1)[0]
    return tokens, out.outputs[0], out.losses[0].item()


def load_hf(out_dir: Path, **kwargs):
    """``from_pretrained`` without its loading bar: the bar's tqdm monitor thread would stay,
    and a later launch refuses to fork."""
    bars = transformers.utils.logging
    bars.disable_progress_bar()
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(str(out_dir), **kwargs)
    finally:
        bars.enable_progress_bar()


def hf_logits(out_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = load_hf(out_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits


def check_export(ckpt: Path, out: Path, **kwargs) -> None:
    export_hf(ckpt, out, **kwargs)
    tokens, ours, _ = one_process_logits(ckpt)
    torch.testing.assert_close(hf_logits(out, tokens), ours, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def gpt_checkpoint(tmp_path_factory) -> Path:
    """The built-in GPT (untied head), pp 2 x vpp 2 interleaved, one step."""
    root = tmp_path_factory.mktemp("gpt")
    cfg = TrainConfig.from_flat(layers=2, hidden=32, heads=4, ffn_hidden=48, vocab=64, pp=2, vpp=2,
                                schedule="interleaved", **BASE)
    train_and_save(cfg, root / "ckpt")
    return root / "ckpt"


def test_builtin_gpt_exports_as_gpt2_with_pipeexecs_logits(gpt_checkpoint, tmp_path):
    out = tmp_path / "hf"
    check_export(gpt_checkpoint, out)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["architectures"] == ["GPT2LMHeadModel"]
    assert config["activation_function"] == "gelu" and config["n_inner"] == 48
    assert (out / SINGLE_FILE).is_file() and not (out / INDEX_FILE).exists()


def test_export_is_refused_with_the_reason(gpt_checkpoint, tmp_path, monkeypatch, capsys):
    out = tmp_path / "hf"
    out.mkdir()
    with pytest.raises(CheckpointError, match="the target exists.*--force"):
        export_hf(gpt_checkpoint, out)
    # an iteration that is not there: the ones that are, listed
    with pytest.raises(CheckpointError, match=r"no checkpoint of iteration 7 .*saved there: 1"):
        export_hf(gpt_checkpoint, tmp_path / "other", tag=7)
    assert cli_main_status(["checkpoint", "export-hf", str(gpt_checkpoint),
                            str(tmp_path / "x"), "--iteration", "7"]) == 1
    assert "saved there: 1" in capsys.readouterr().err
    # safetensors missing: named, before anything is written
    monkeypatch.setitem(sys.modules, "safetensors", None)
    with pytest.raises(CheckpointError, match="needs the safetensors package"):
        export_hf(gpt_checkpoint, tmp_path / "nost")
    assert not (tmp_path / "nost").exists()
    monkeypatch.undo()
    # --force replaces the directory (the stale file gone)
    (out / "stale.safetensors").write_text("x")
    assert cli_main_status(["checkpoint", "export-hf", str(gpt_checkpoint), str(out),
                            "--force"]) == 0
    assert not (out / "stale.safetensors").exists() and (out / SINGLE_FILE).is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]    # no temp left


def cli_main_status(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exc:
        cli_main(argv)
    return exc.value.code


def test_sharded_export_writes_an_index_that_transformers_loads(gpt_checkpoint, tmp_path):
    out = tmp_path / "hf"
    check_export(gpt_checkpoint, out, max_shard_bytes=20_000)
    index = json.loads((out / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and not (out / SINGLE_FILE).exists()
    assert all((out / f).is_file() for f in files)
    from safetensors import safe_open
    total = 0
    for f in files:
        with safe_open(str(out / f), "pt") as h:
            total += sum(h.get_tensor(k).numel() * 4 for k in h.keys())
    assert index["metadata"]["total_size"] == total


def test_bfloat16_export_is_the_fp32_export_rounded(gpt_checkpoint, tmp_path):
    from safetensors.torch import load_file
    export_hf(gpt_checkpoint, tmp_path / "fp32")
    assert cli_main_status(["checkpoint", "export-hf", str(gpt_checkpoint),
                            str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    full, half = (load_file(str(tmp_path / d / SINGLE_FILE)) for d in ("fp32", "bf16"))
    assert full.keys() == half.keys()
    for k in full:
        assert half[k].dtype == torch.bfloat16 and torch.equal(half[k], full[k].bfloat16())
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    model = load_hf(tmp_path / "bf16")
    assert next(model.parameters()).dtype == torch.bfloat16


def test_shard_plan_packs_in_order_and_keeps_a_big_tensor_alone():
    sizes = {"a": 4, "b": 4, "c": 9, "d": 1}
    assert shard_plan(list(sizes), sizes, 8) == [["a", "b"], ["c"], ["d"]]
    assert shard_plan(list(sizes), sizes, 100) == [["a", "b", "c", "d"]]


def test_tokenizer_files_are_copied(tmp_path):
    src, dst = tmp_path / "tok", tmp_path / "out"
    src.mkdir()
    dst.mkdir()
    (src / "tokenizer.json").write_text("{}")
    (src / "tokenizer_config.json").write_text("{}")
    (src / "unrelated.txt").write_text("")
    assert copy_tokenizer(src, dst) == ["tokenizer.json", "tokenizer_config.json"]
    assert sorted(p.name for p in dst.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    with pytest.raises(CheckpointError, match="does not exist"):
        copy_tokenizer(tmp_path / "none", dst)


def test_tied_builtin_gpt_and_hf_model_resume(tmp_path):
    """A tied head is written once (GPT-2's wte); ``--hf-model OUT_DIR`` then trains from the
    exported weights: its first forward loss is the checkpoint's."""
    cfg = TrainConfig.from_flat(layers=2, hidden=32, heads=4, vocab=64, pp=2, tie_embeddings=True,
                                **BASE)
    train_and_save(cfg, tmp_path / "ckpt")
    out = tmp_path / "hf"
    check_export(tmp_path / "ckpt", out)
    from safetensors import safe_open
    with safe_open(str(out / SINGLE_FILE), "pt") as h:
        assert "lm_head.weight" not in h.keys() and "transformer.wte.weight" in h.keys()
    assert_hf_model_resumes(tmp_path / "ckpt", out)


def assert_hf_model_resumes(ckpt: Path, out: Path) -> None:
    """``--hf-model OUT_DIR`` (the run's batch, one process): the first loss is the
    checkpoint's, so the exported weights were loaded."""
    _, _, loss = one_process_logits(ckpt)
    resumed = one_process_config(ckpt).with_hf_model(str(out))
    assert resumed.inputs.hf_model == str(out)
    assert assemble(resumed, fake_topology()).forward(0).losses[0].item() == pytest.approx(
        loss, rel=1e-5)


def family_config(family: str, root: Path, **layout) -> TrainConfig:
    return TrainConfig.from_flat(**BASE, **layout).with_hf_model(model_dir(root, family))


@pytest.mark.parametrize("family,layout", [
    ("llama", dict(pp=2)),
    ("mixtral", dict(dp=2, ep=2, zero=1)),
])
def test_family_export_from_two_ranks_matches_pipeexecs_forward(family, layout, tmp_path):
    cfg = family_config(family, tmp_path, **layout)
    train_and_save(cfg, tmp_path / "ckpt")
    check_export(tmp_path / "ckpt", tmp_path / "hf")
    assert_hf_model_resumes(tmp_path / "ckpt", tmp_path / "hf")


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen2_moe", "qwen3_moe", "gpt2",
                                    "llama-tied"])
def test_every_family_exports_as_itself(family, tmp_path):
    cfg = family_config(family, tmp_path, pp=2)
    train_and_save(cfg, tmp_path / "ckpt")
    check_export(tmp_path / "ckpt", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == FAMILIES[family]["model_type"]


@pytest.mark.slow
@pytest.mark.parametrize("family,layout", [
    ("llama", dict(tp=2, pp=2)),
    ("mixtral", dict(tp=2, pp=2)),
    ("llama", dict(pp=2, dp=2, zero=1)),
    ("mixtral", dict(pp=2, dp=2, zero=1)),
    ("llama", dict(cp=2)),
    ("mixtral", dict(dp=2, zero=3)),
    ("llama", dict(tp=2, sequence_parallel=True, pp=2, vpp=2, schedule="zbv")),
])
def test_family_export_from_more_layouts_matches_pipeexecs_forward(family, layout, tmp_path):
    cfg = family_config(family, tmp_path, **layout)
    train_and_save(cfg, tmp_path / "ckpt")
    check_export(tmp_path / "ckpt", tmp_path / "hf")
