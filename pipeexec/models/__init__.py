"""Models the executor builds from a run's config: the built-in GPT (`pipeexec.model`) or a
Hugging Face model directory (`pipeexec.models.hf`, ``--hf-model``). Importing this package
imports no torch (`hf_config` is read before any worker starts, on machines without it)."""
from __future__ import annotations

from typing import Any


def spec_from_config(config: Any):
    """The `pipeexec.model.ModelSpec` ``config`` trains: its ``hf_model`` directory when set,
    else the built-in GPT of its model fields."""
    if getattr(config, "hf_model", None):
        from .hf import hf_model_spec
        return hf_model_spec(config.hf_model)
    from ..model import gpt_spec_from_config
    return gpt_spec_from_config(config)
