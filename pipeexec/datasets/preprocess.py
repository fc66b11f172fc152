"""``pipeexec preprocess-data``: tokenize a corpus into Megatron's indexed dataset, as
Megatron-LM's ``tools/preprocess_data.py`` does for GPT.

Input: a ``.jsonl`` file (one JSON object a line, the text under ``--json-keys``; a list of
strings is one document of several sentences, as Megatron reads it) or a ``.txt`` file (one
document per paragraph: documents are separated by blank lines). Each document is one
sequence of its token ids, the end-of-document token appended (``--append-eod``, Megatron's GPT
recipe); an empty document is a document of no sequence. Worker processes tokenize chunks of
documents in parallel; their results are written in input order. The output is ``PREFIX.bin``
and ``PREFIX.idx`` (``PREFIX_KEY.*`` per key when several keys are given), written under
temporary names and renamed into place when complete.
"""
from __future__ import annotations

import json
import multiprocessing
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .indexed import IndexedDatasetWriter, bin_path, idx_path, optimal_dtype
from .tokenizer import Tokenizer, load_tokenizer

CHUNK = 64          # documents per task sent to a worker


class PreprocessError(ValueError):
    pass


@dataclass(frozen=True)
class PreprocessOptions:
    input: str
    tokenizer: str
    output_prefix: str
    json_keys: tuple[str, ...] = ("text",)
    workers: int = 1
    append_eod: bool = True
    force: bool = False
    progress: bool = True


@dataclass(frozen=True)
class PreprocessResult:
    outputs: tuple[str, ...]          # the prefixes written
    documents: int
    tokens: int


def outputs_of(opts: PreprocessOptions) -> tuple[str, ...]:
    """The output prefixes: PREFIX for one key, PREFIX_KEY for each of several."""
    if len(opts.json_keys) == 1:
        return (opts.output_prefix,)
    return tuple(f"{opts.output_prefix}_{k}" for k in opts.json_keys)


def check_options(opts: PreprocessOptions) -> Tokenizer:
    """Everything that can be refused before tokenizing; returns the tokenizer."""
    path = Path(opts.input)
    if not path.is_file():
        raise PreprocessError(f"--input {opts.input}: no such file")
    if path.suffix.lower() not in (".jsonl", ".json", ".txt"):
        raise PreprocessError(f"--input {opts.input}: a .jsonl (one JSON object a line) or .txt "
                              "(documents separated by blank lines) file")
    if isinstance(opts.workers, bool) or not isinstance(opts.workers, int) or opts.workers < 1:
        raise PreprocessError(f"--workers must be a positive integer, got {opts.workers!r}")
    if not opts.json_keys or len(set(opts.json_keys)) != len(opts.json_keys):
        raise PreprocessError(f"--json-keys: give distinct keys, got {list(opts.json_keys)}")
    for prefix in outputs_of(opts):
        if not Path(prefix).parent.is_dir():
            raise PreprocessError(f"--output-prefix {opts.output_prefix}: folder "
                                  f"{Path(prefix).parent} does not exist")
        there = [str(p) for p in (bin_path(prefix), idx_path(prefix)) if p.exists()]
        if there and not opts.force:
            raise PreprocessError(f"--output-prefix {opts.output_prefix}: {', '.join(there)} "
                                  f"{'exist' if len(there) > 1 else 'exists'}; pass --force to "
                                  "replace")
    tokenizer = load_tokenizer(opts.tokenizer)
    if opts.append_eod and tokenizer.eod is None:
        raise PreprocessError(f"--tokenizer {opts.tokenizer} has no eos_token to end documents "
                              "with; set one in its tokenizer_config.json, or pass "
                              "--no-append-eod")
    return tokenizer


def _documents(path: Path) -> Iterator[tuple[int, str, int]]:
    """(line number, raw document, bytes) in input order: a .jsonl's lines, or a .txt's
    blank-line-separated paragraphs (numbered by their first line)."""
    with open(path, encoding="utf-8", errors="strict") as f:
        if path.suffix.lower() != ".txt":
            for n, line in enumerate(f, 1):
                if line.strip():
                    yield n, line, len(line.encode())
            return
        lines: list[str] = []
        first = 0
        for n, line in enumerate(f, 1):
            if line.strip():
                if not lines:
                    first = n
                lines.append(line)
            elif lines:
                text = "".join(lines)
                yield first, text, len(text.encode())
                lines = []
        if lines:
            text = "".join(lines)
            yield first, text, len(text.encode())


# -- worker side: one tokenizer per process, set by the pool's initializer -------------------
_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer: Tokenizer, keys: tuple[str, ...], jsonl: bool, eod: int | None
                 ) -> None:
    _WORKER.update(tokenizer=tokenizer, keys=keys, jsonl=jsonl, eod=eod)


def _encode_chunk(chunk: list[tuple[int, str]]) -> list[tuple[int, Any]]:
    """Per document: (line, [(ids, sentence lengths) per key]) or (line, error text)."""
    tok, keys, jsonl, eod = (_WORKER[k] for k in ("tokenizer", "keys", "jsonl", "eod"))
    out = []
    for line_no, raw in chunk:
        try:
            out.append((line_no, _encode(raw, tok, keys, jsonl, eod)))
        except ValueError as exc:
            out.append((line_no, str(exc)))
    return out


def _encode(raw: str, tok: Tokenizer, keys: Sequence[str], jsonl: bool, eod: int | None):
    if not jsonl:
        texts = {keys[0]: raw}
    else:
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, not an object")
        missing = [k for k in keys if k not in data]
        if missing:
            raise ValueError(f"no key {', '.join(map(repr, missing))} (--json-keys; it has "
                             f"{', '.join(map(repr, list(data)[:8]))})")
        texts = {k: data[k] for k in keys}
    result = []
    for key, text in texts.items():
        sentences = text if isinstance(text, list) else [text]
        if not all(isinstance(s, str) for s in sentences):
            raise ValueError(f"key {key!r} holds a {type(text).__name__}, not text")
        ids: list[int] = []
        lengths: list[int] = []
        for s in sentences:
            piece = tok.encode(s)
            if piece:
                ids.extend(piece)
                lengths.append(len(piece))
        if ids and eod is not None:
            ids.append(eod)
            lengths[-1] += 1
        result.append((ids, lengths))
    return result


def _chunks(docs: Iterator[tuple[int, str, int]], size: int, sizes: list[int]
            ) -> Iterator[list[tuple[int, str]]]:
    chunk: list[tuple[int, str]] = []
    nbytes = 0
    for line_no, raw, n in docs:
        chunk.append((line_no, raw))
        nbytes += n
        if len(chunk) == size:
            sizes.append(nbytes)
            yield chunk
            chunk, nbytes = [], 0
    if chunk:
        sizes.append(nbytes)
        yield chunk


def _bounded_imap(pool: Any, tasks: Iterator[list[tuple[int, str]]], ahead: int
                  ) -> Iterator[list[tuple[int, Any]]]:
    """``pool.imap(_encode_chunk, tasks)`` in input order, with at most ``ahead`` chunks read
    and not yet written (``imap`` reads its whole input ahead: a large corpus would sit in
    memory)."""
    from collections import deque

    pending: deque = deque()
    for task in tasks:
        pending.append(pool.apply_async(_encode_chunk, (task,)))
        if len(pending) >= ahead:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def preprocess(opts: PreprocessOptions) -> PreprocessResult:
    """Tokenize ``opts.input`` into the indexed dataset(s) at ``outputs_of(opts)``."""
    import numpy as np

    from pipesim.progress import progress_bar

    tokenizer = check_options(opts)
    path = Path(opts.input)
    jsonl = path.suffix.lower() != ".txt"
    dtype = optimal_dtype(tokenizer.vocab_size)
    eod = tokenizer.eod if opts.append_eod else None
    writers = [IndexedDatasetWriter(p, dtype) for p in outputs_of(opts)]
    documents = tokens = 0
    sizes: list[int] = []
    bar = progress_bar(total=path.stat().st_size, unit="B", unit_scale=True, desc="tokenize",
                       file=sys.stderr, disable=not opts.progress, leave=False)
    pool = None
    try:
        tasks = _chunks(_documents(path), CHUNK, sizes)
        if opts.workers > 1:
            ctx = multiprocessing.get_context("fork" if sys.platform != "win32" else "spawn")
            pool = ctx.Pool(opts.workers, initializer=_init_worker,
                            initargs=(tokenizer, opts.json_keys, jsonl, eod))
            results = _bounded_imap(pool, tasks, ahead=4 * opts.workers)
        else:
            _init_worker(tokenizer, opts.json_keys, jsonl, eod)
            results = map(_encode_chunk, tasks)
        for k, chunk in enumerate(results):
            for line_no, encoded in chunk:
                if isinstance(encoded, str):
                    where = f"line {line_no}" if jsonl else f"the document at line {line_no}"
                    raise PreprocessError(f"{opts.input}: {where}: {encoded}")
                for writer, (ids, lengths) in zip(writers, encoded):
                    try:
                        writer.add_document(np.asarray(ids, dtype=np.int64), lengths)
                    except ValueError as exc:     # ids past what the token dtype holds
                        raise PreprocessError(f"{opts.input}: line {line_no}: {exc} (the "
                                              f"tokenizer says {tokenizer.vocab_size} ids)") from None
                    tokens += len(ids)
                documents += 1
            bar.update(sizes[k])
        for w in writers:
            w.finish()
    except UnicodeDecodeError as exc:
        for w in writers:
            w.abort()
        raise PreprocessError(f"{opts.input}: not UTF-8 text (byte {exc.start} of a read "
                              f"block is {exc.object[exc.start]:#04x})") from None
    except BaseException:
        for w in writers:
            w.abort()
        raise
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
            pool.join()
    return PreprocessResult(outputs_of(opts), documents, tokens)
