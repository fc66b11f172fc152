"""Test fixtures for the data path, made on the spot (nothing downloaded): a small corpus and a
byte-level BPE tokenizer trained on it with `tokenizers`, saved as a Hugging Face tokenizer
folder (``PreTrainedTokenizerFast.save_pretrained``)."""
from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ("the pipeline sends activations forward and gradients back while every stage keeps "
         "its weights a schedule orders the microbatches so that bubbles stay small data "
         "parallel replicas average their gradients tensor parallel ranks cut each layer "
         "tokens become embeddings attention mixes them and the head predicts the next one").split()
EOD = "<|endoftext|>"


def make_corpus(dir: str | Path, *, documents: int = 200, seed: int = 0,
                name: str = "corpus.jsonl") -> Path:
    """``dir/name``: ``documents`` JSON lines ``{"text": ...}`` of 1-6 sentences of random
    words (deterministic in ``seed``); a ``.txt`` name writes the same documents as
    blank-line-separated paragraphs."""
    rng = random.Random(seed)
    texts = []
    for _ in range(documents):
        sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 14))).capitalize()
                     + "." for _ in range(rng.randint(1, 6))]
        texts.append(" ".join(sentences))
    path = Path(dir) / name
    if path.suffix == ".txt":
        path.write_text("\n\n".join(texts) + "\n")
    else:
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def make_tokenizer(dir: str | Path, corpus: str | Path, vocab_size: int = 300) -> Path:
    """A byte-level BPE of ``vocab_size`` ids trained on ``corpus`` (its text values, or the
    file's text), saved with ``save_pretrained`` in ``dir``; ``<|endoftext|>`` is its eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = Path(corpus)
    if corpus.suffix == ".jsonl":
        texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines() if line]
    else:
        texts = corpus.read_text().split("\n\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOD).save_pretrained(str(out))
    return out


def indexed_corpus(dir: str | Path, *, documents: int = 120, vocab_size: int = 300
                   ) -> tuple[Path, Path]:
    """A corpus of ``documents`` (`make_corpus`), its tokenizer (`make_tokenizer`) and the
    indexed dataset `pipeexec preprocess-data` makes of them: (prefix, tokenizer folder)."""
    from pipeexec.datasets.preprocess import PreprocessOptions, preprocess

    d = Path(dir)
    text = make_corpus(d, documents=documents)
    tok = make_tokenizer(d / "tok", text, vocab_size)
    preprocess(PreprocessOptions(input=str(text), tokenizer=str(tok), output_prefix=str(d / "c"),
                                 progress=False))
    return d / "c", tok
