"""What forked workers share: `launch(..., preload=...)` imports the modules every worker will
import in the parent first, so the workers start with them (a Hugging Face family's modeling
module costs each rank about a CPU second otherwise); a module that cannot be imported is left
to the workers. `worker_modules` names them for a run: a family's, none for the built-in GPT."""
from __future__ import annotations

import json
import sys

from pipeexec import TrainConfig, launch
from pipeexec.models import worker_modules


def _imported(board, name: str) -> bool:
    return name in sys.modules


def test_preloaded_modules_are_in_the_workers_from_their_start(tmp_path, monkeypatch):
    name = "pipeexec_preload_probe"              # imported by nothing else
    (tmp_path / f"{name}.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert launch(_imported, 2, (name,)) == [False, False]
        assert launch(_imported, 2, (name,), preload=[name, "no_such_module_anywhere"]) \
            == [True, True]
        assert name in sys.modules
    finally:
        sys.modules.pop(name, None)


def test_a_run_names_its_families_modeling_module(tmp_path):
    assert worker_modules(TrainConfig()) == ()
    (tmp_path / "config.json").write_text(json.dumps(dict(
        model_type="mixtral", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=32, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64)))
    assert worker_modules(TrainConfig().with_hf_model(str(tmp_path))) == (
        "pipeexec.models.hf", "transformers.models.mixtral.modeling_mixtral")
