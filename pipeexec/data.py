"""Deterministic data: a global batch per step, split into dp replicas x m microbatches.

The batch of step ``k`` is a pure function of ``(seed, k)``, so any layout sees the same global
batch, a resumed run continues with exactly the batches it would have seen (the data position
is just the step: ``consumed_samples = k * global_batch``), and no rank needs another's data.
Row ``r`` of the global batch goes to replica ``r // (m * b)``, microbatch ``(r // b) % m``.

Synthetic sequences are learnable (arithmetic progressions modulo the vocabulary with a random
start and a stride from a small set), so a training loss visibly falls. A text file is read as
bytes (vocabulary 256), or tokenized with ``--tokenizer``, and cut into random windows.

``--data-path`` (`IndexedBatches`): Megatron's indexed datasets (`pipeexec.datasets`), the
global batch of step ``k`` being samples ``k * global_batch ..`` of the train split, so the
position is ``consumed_samples`` as in Megatron; only a replica's own rows are read.
"""
from __future__ import annotations

from pathlib import Path

import torch

STRIDES = (1, 2, 3, 5, 7)


class DataError(ValueError):
    pass


class BatchSource:
    """Global batches of (inputs, targets), each (global_batch, seq_len) int64."""

    def __init__(self, *, seed: int, seq_len: int, vocab: int, global_batch: int,
                 data: str = "synthetic", tokenizer: str | None = None) -> None:
        self.seed, self.seq_len, self.vocab, self.global_batch = seed, seq_len, vocab, global_batch
        self.data = data
        self._text: torch.Tensor | None = None
        if data != "synthetic":
            path = Path(data)
            if not path.is_file():
                raise DataError(f"data file {data!r} does not exist")
            if tokenizer is not None:
                from .datasets.tokenizer import load_tokenizer

                ids = load_tokenizer(tokenizer).encode(path.read_text(encoding="utf-8"))
                self._text = torch.tensor(ids, dtype=torch.int64)
                unit = "tokens"
            else:
                raw = path.read_bytes()
                self._text = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)
                unit = "bytes"
            if len(self._text) < seq_len + 2:
                raise DataError(f"data file {data!r} has {len(self._text)} {unit}, fewer than "
                                f"seq_len + 2 = {seq_len + 2}")

    def _generator(self, step: int) -> torch.Generator:
        return torch.Generator().manual_seed((self.seed * 1_000_003 + step * 97 + 1) % (2 ** 63 - 1))

    def global_batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g, s = self.global_batch, self.seq_len
        gen = self._generator(step)
        if self._text is None:
            start = torch.randint(0, self.vocab, (g, 1), generator=gen)
            stride = torch.tensor(STRIDES)[torch.randint(0, len(STRIDES), (g, 1), generator=gen)]
            seq = (start + stride * torch.arange(s + 1)) % self.vocab
        else:
            offsets = torch.randint(0, len(self._text) - s - 1, (g,), generator=gen)
            seq = torch.stack([self._text[o: o + s + 1] for o in offsets.tolist()])
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    def microbatches(self, step: int, dp_rank: int, dp: int, m: int
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The m microbatches of replica ``dp_rank`` at ``step``, each in storage of its own (as
        Megatron fetches each microbatch apart): a stage that keeps a microbatch's tokens for its
        backward then holds that microbatch only, and memory meters count just that."""
        if self.global_batch % (dp * m):
            raise DataError(f"global batch {self.global_batch} is not divisible by dp * m = {dp * m}")
        b = self.global_batch // (dp * m)
        x, y = self.global_batch_at(step)
        base = dp_rank * m * b
        return [(x[base + k * b: base + (k + 1) * b].clone(),
                 y[base + k * b: base + (k + 1) * b].clone()) for k in range(m)]


class IndexedBatches(BatchSource):
    """Global batches from the train split of ``--data-path`` (`pipeexec.datasets`): row ``r``
    of step ``k`` is train sample ``k * global_batch + r``. A sample holding an id the model
    has no embedding for is refused, naming it."""

    def __init__(self, train, *, seq_len: int, vocab: int, global_batch: int,
                 source: str = "--data-path") -> None:
        self.train, self.seq_len, self.vocab, self.global_batch = train, seq_len, vocab, global_batch
        self.source = source

    def rows(self, step: int, first: int, count: int) -> torch.Tensor:
        """Rows ``first .. first + count - 1`` of step ``step``'s global batch, (count, s + 1)."""
        import numpy as np

        base = step * self.global_batch + first
        if base + count > len(self.train):
            raise DataError(f"{self.source}: step {step} needs train samples up to "
                            f"{base + count - 1}, the train split holds {len(self.train)} "
                            "(built for --steps x the global batch)")
        seq = torch.from_numpy(np.stack([self.train[base + i] for i in range(count)]))
        if seq.numel() and int(seq.max()) >= self.vocab:
            raise DataError(f"{self.source}: train samples {base}..{base + count - 1} hold token "
                            f"id {int(seq.max())}, the model's vocabulary is {self.vocab} "
                            "(--vocab): pass the tokenizer's vocabulary size or more")
        return seq

    def global_batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        seq = self.rows(step, 0, self.global_batch)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    def microbatches(self, step: int, dp_rank: int, dp: int, m: int
                     ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.global_batch % (dp * m):
            raise DataError(f"global batch {self.global_batch} is not divisible by dp * m = {dp * m}")
        b = self.global_batch // (dp * m)
        seq = self.rows(step, dp_rank * m * b, m * b)
        return [(seq[k * b:(k + 1) * b, :-1].contiguous(), seq[k * b:(k + 1) * b, 1:].contiguous())
                for k in range(m)]


def batch_source(config) -> BatchSource:
    """The run's batches: ``--data-path``'s train split, else synthetic or ``--data FILE``."""
    model = config.plan.model
    if config.inputs.data_path:
        from .datasets import build_datasets

        train, _, _ = build_datasets(config)
        return IndexedBatches(train, seq_len=model.seq_length, vocab=model.vocab,
                              global_batch=config.global_batch)
    return BatchSource(seed=config.runtime.seed, seq_len=model.seq_length, vocab=model.vocab,
                       global_batch=config.global_batch, data=config.inputs.data,
                       tokenizer=config.inputs.tokenizer)
