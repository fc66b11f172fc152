"""The model presets that are Hugging Face models carry their family and config.json: a plan
made from one runs on pipeexec as that family's transformers model, and `pipesim models NAME
--config-out DIR` writes the file, which transformers' own config class reads as the preset's
shape."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from pipesim.__main__ import main as pipesim_main
from pipesim.plan.hf_config import hf_config_for
from pipesim.plan.model import PRESETS, ModelSpec, get_model

FAMILY_PRESETS = sorted(n for n, m in PRESETS.items() if m.family is not None)


def test_every_preset_of_a_hugging_face_architecture_names_its_family():
    families = {n: PRESETS[n].family for n in FAMILY_PRESETS}
    assert families["llama3-8b"] == families["llama3-405b"] == "llama"
    assert families["mixtral-8x7b"] == "mixtral" and families["gpt3-175b"] == "gpt2"
    assert families["qwen1.5-moe-a2.7b"] == "qwen2_moe" and families["qwen3-30b-a3b"] == "qwen3_moe"


@pytest.mark.parametrize("name", FAMILY_PRESETS)
def test_a_preset_reads_back_from_its_config(name):
    preset = PRESETS[name]
    back = ModelSpec.from_hf_config(hf_config_for(preset), name=name, seq_length=preset.seq_length)
    if preset.max_position is None and back.max_position == preset.seq_length:
        back = replace(back, max_position=None)        # GPT-2's table: as long as the sequence
    assert back == preset and back.num_params() == preset.num_params()


@pytest.mark.parametrize("name", ["llama3-8b", "mixtral-8x7b", "qwen3-30b-a3b", "gpt3-1.3b"])
def test_config_out_is_read_by_transformers_as_the_preset(name, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    assert pipesim_main(["models", name, "--config-out", str(tmp_path / name)]) == 0
    assert f"--model {tmp_path / name}" in capsys.readouterr().out
    cfg = transformers.AutoConfig.from_pretrained(str(tmp_path / name), local_files_only=True)
    preset = PRESETS[name]
    if preset.family == "gpt2":
        assert (cfg.n_layer, cfg.n_embd, cfg.n_head) == (preset.layers, preset.hidden, preset.heads)
    else:
        assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads,
                cfg.num_key_value_heads, cfg.vocab_size) == (
            preset.layers, preset.hidden, preset.heads, preset.num_kv_heads, preset.vocab)
    # the folder is a model a plan can name
    read = get_model(str(tmp_path / name))
    assert (read.layers, read.hidden, read.ffn, read.experts, read.family) == (
        preset.layers, preset.hidden, preset.ffn, preset.experts, preset.family)


def test_config_out_refuses_to_overwrite_and_needs_a_name(tmp_path):
    out = tmp_path / "l8"
    assert pipesim_main(["models", "llama3-8b", "--config-out", str(out)]) == 0
    before = (out / "config.json").read_text()
    assert pipesim_main(["models", "llama3-70b", "--config-out", str(out)]) == 2
    assert (out / "config.json").read_text() == before
    assert pipesim_main(["models", "llama3-70b", "--config-out", str(out), "--force"]) == 0
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 80
    assert pipesim_main(["models", "--config-out", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()


def test_a_preset_plan_is_built_as_its_family():
    """What `pipeexec train --plan` of a plan made with ``--model llama3-8b`` builds (shrunk to
    run here): transformers' own Llama decoder layers, no refusal."""
    pytest.importorskip("transformers")
    import pipesim
    from pipeexec.config import TrainConfig
    from pipeexec.models import layer_stack, model_refusals

    small = replace(PRESETS["llama3-8b"], layers=2, hidden=64, heads=4, kv_heads=2,
                    ffn_hidden=128, vocab=256, seq_length=32, vocab_divisible_by=1)
    plan = pipesim.Plan.create(small, "A100", schedule="1f1b", pp=1, dp=1, micro_batch_size=1,
                               global_batch_size=1, precision="fp32")
    assert model_refusals(plan.model) == []
    stack = layer_stack(TrainConfig.from_flat(plan=plan, device="cpu"))
    import torch

    block = stack.factory(1, torch.Generator().manual_seed(0))       # layer 0: the embedding
    assert "LlamaDecoderLayer" in {type(m).__name__ for m in block.modules()}
    assert stack.blocks == 2
