"""transformers renamed the masks' cache argument (``past_key_values`` in 5.0-5.1x, ``cache``
in 5.2x): a decoder layer asks the installed function which it takes (an H200 with 5.17 failed
on ``cache=``)."""
from __future__ import annotations

import inspect

from pipeexec.models.hf import cache_keyword


def test_thecache_keyword_follows_the_installed_signature():
    def old(config, inputs_embeds, attention_mask, past_key_values=None, position_ids=None):
        return None

    def new(config, inputs_embeds, attention_mask, cache, position_ids=None, *,
            past_key_values=None):
        return None

    assert cache_keyword(old) == "past_key_values"
    assert cache_keyword(new) == "cache"
    from transformers.masking_utils import create_causal_mask

    assert cache_keyword(create_causal_mask) in inspect.signature(create_causal_mask).parameters
