"""The Qwen MoE families as layer lists: Qwen2-MoE (a shared expert with its sigmoid gate,
``norm_topk_prob``, q/k/v biases) and Qwen3-MoE (per-head q/k norms) compute exactly the
unsplit ``AutoModelForCausalLM``'s logits given the same weights, load ``save_pretrained``'s
safetensors (whatever layout of the experts this transformers writes), and count the
parameters pipesim's `ModelSpec` counts. Their pipelined training (with and without the
routers' loss) is tests/exec/test_router_loss.py's."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pipesim.plan.model import ModelSpec  # noqa: E402
from pipeexec.models.hf import hf_dir_stack, hf_reference_model  # noqa: E402
from pipeexec.models.hf_config import read_hf_config  # noqa: E402

from test_hf_models import write_model  # noqa: E402

_BASE = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=32, max_position_embeddings=64, bos_token_id=1,
             eos_token_id=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24)
MODELS = {
    "qwen2_moe": dict(model_type="qwen2_moe", shared_expert_intermediate_size=40,
                      norm_topk_prob=True, **_BASE),
    "qwen3_moe": dict(model_type="qwen3_moe", head_dim=16, **_BASE),
}


def _run(spec, x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    h = x
    for i in range(spec.num_layers):
        h = spec.build_layer(i, seed)(h)
    return h


@pytest.mark.parametrize("family", MODELS)
def test_layer_list_computes_the_unsplit_models_logits(tmp_path, family):
    directory = write_model(tmp_path / family, MODELS[family])
    spec = hf_dir_stack(directory)
    x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf_reference_model(directory, seed=5)(input_ids=x).logits
    torch.testing.assert_close(_run(spec, x, 5), want, rtol=1e-6, atol=1e-6)
    model = ModelSpec.from_hf_config(str(directory), seq_length=8)
    counts = spec.layer_param_counts()
    assert [sum(model.layer_params(m).values()) for m in model.moe_pattern()] == list(counts[1:-1])


@pytest.mark.parametrize("family", MODELS)
def test_saved_checkpoint_loads_into_the_layers(tmp_path, family):
    config = transformers.AutoConfig.for_model(**MODELS[family])
    torch.manual_seed(3)
    saved = transformers.AutoModelForCausalLM.from_config(config)
    transformers.utils.logging.disable_progress_bar()   # no tqdm thread before a fork
    try:
        saved.save_pretrained(tmp_path)
    finally:
        transformers.utils.logging.enable_progress_bar()
    assert read_hf_config(tmp_path).checkpoint_files
    x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(_run(hf_dir_stack(tmp_path), x), saved(input_ids=x).logits,
                                   rtol=1e-6, atol=1e-6)
