"""A Hugging Face tokenizer from a local folder (``--tokenizer DIR``), never the hub.

A folder with a ``tokenizer.json`` (what ``PreTrainedTokenizerFast.save_pretrained`` writes)
is read with the ``tokenizers`` library alone, which is fast to import and to pickle into
worker processes; any other folder through ``transformers.AutoTokenizer`` with
``local_files_only``. The end-of-document token is the tokenizer's ``eos_token`` (as
Megatron's HuggingFaceTokenizer takes its ``eod``)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class TokenizerError(ValueError):
    pass


@dataclass(frozen=True)
class Tokenizer:
    """``encode(text) -> list[int]``, ``vocab_size`` (every id it can give, added tokens
    included) and ``eod`` (the end-of-document id, or None)."""

    path: str
    vocab_size: int
    eod: int | None
    _impl: Any

    def encode(self, text: str) -> list[int]:
        if hasattr(self._impl, "encode_batch"):              # tokenizers.Tokenizer
            return self._impl.encode(text, add_special_tokens=False).ids
        return self._impl.encode(text, add_special_tokens=False)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if hasattr(self._impl, "encode_batch"):
            return [e.ids for e in self._impl.encode_batch(texts, add_special_tokens=False)]
        return [self.encode(t) for t in texts]


def load_tokenizer(path: str) -> Tokenizer:
    """The tokenizer saved in folder ``path``. TokenizerError names the folder and the reason."""
    folder = Path(path)
    if not folder.is_dir():
        raise TokenizerError(f"--tokenizer {path}: no such folder (a Hugging Face tokenizer saved "
                             "with save_pretrained: tokenizer.json, tokenizer_config.json)")
    if (folder / "tokenizer.json").is_file():
        from tokenizers import Tokenizer as FastTokenizer

        try:
            impl = FastTokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as exc:                     # the library's own parse error
            raise TokenizerError(f"--tokenizer {path}: tokenizer.json does not load: {exc}") from None
        eos = _eos_token(folder)
        eod = impl.token_to_id(eos) if eos is not None else None
        if eos is not None and eod is None:
            raise TokenizerError(f"--tokenizer {path}: its eos_token {eos!r} is not in its "
                                 "vocabulary")
        return Tokenizer(str(path), impl.get_vocab_size(with_added_tokens=True), eod, impl)
    try:
        from transformers import AutoTokenizer

        impl = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as exc:                         # OSError, ValueError: the library's reason
        raise TokenizerError(f"--tokenizer {path}: not a Hugging Face tokenizer folder: "
                             f"{exc}") from None
    return Tokenizer(str(path), len(impl), impl.eos_token_id, impl)


def _eos_token(folder: Path) -> str | None:
    """The eos token's text from tokenizer_config.json or special_tokens_map.json."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        f = folder / name
        if not f.is_file():
            continue
        try:
            eos = json.loads(f.read_text()).get("eos_token")
        except (OSError, json.JSONDecodeError, AttributeError):
            continue
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            return eos
    return None


def check_vocab(tokenizer: Tokenizer, model_vocab: int) -> None:
    """Refuse a tokenizer that can give ids the model has no embedding for."""
    if tokenizer.vocab_size > model_vocab:
        raise TokenizerError(
            f"--tokenizer {tokenizer.path} has a vocabulary of {tokenizer.vocab_size} ids, the "
            f"model's is {model_vocab} (--vocab): ids >= {model_vocab} would index past the "
            f"embedding; pass --vocab {tokenizer.vocab_size} or more, or a smaller tokenizer")
