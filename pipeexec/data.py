"""Deterministic data: a global batch per step, split into dp replicas x m microbatches.

The batch of step ``k`` is a pure function of ``(seed, k)``, so any layout sees the same global
batch, a resumed run continues with exactly the batches it would have seen (the data position
is just the step: ``consumed_samples = k * global_batch``), and no rank needs another's data.
Row ``r`` of the global batch goes to replica ``r // (m * b)``, microbatch ``(r // b) % m``.

Synthetic sequences are learnable (arithmetic progressions modulo the vocabulary with a random
start and a stride from a small set), so a training loss visibly falls. A text file is read as
bytes (vocabulary 256) and cut into random windows.
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
                 data: str = "synthetic") -> None:
        self.seed, self.seq_len, self.vocab, self.global_batch = seed, seq_len, vocab, global_batch
        self.data = data
        self._text: torch.Tensor | None = None
        if data != "synthetic":
            path = Path(data)
            if not path.is_file():
                raise DataError(f"data file {data!r} does not exist")
            raw = path.read_bytes()
            if len(raw) < seq_len + 2:
                raise DataError(f"data file {data!r} has {len(raw)} bytes, fewer than seq_len + 2 "
                                f"= {seq_len + 2}")
            self._text = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)

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
