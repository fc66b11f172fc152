"""GPT samples from an indexed dataset, as Megatron-Core's ``GPTDataset`` draws them.

The documents of a split (a contiguous range of the corpus's sequences) are repeated for as
many epochs as the requested samples need, shuffled together with ``numpy.random.RandomState
(seed)`` (the last epoch shuffled on its own when it is used for less than 80% of its samples),
concatenated and cut into samples of ``seq_len + 1`` tokens, consecutive samples sharing one
token (the next sample's first input is this one's last target); the sample order is then
shuffled with the same random state. Every step of that is Megatron's, so the same corpus,
seed and sample count give the same samples as a Megatron run (tests/test_gpt_dataset.py
compares them with Megatron-Core's own builder).

The sample index (Megatron's C++ ``build_sample_idx``) is computed here with numpy: sample
``i`` starts at token ``i * seq_len`` of the concatenation, and the boundaries falling inside
each document follow from its first and last token's position.
"""
from __future__ import annotations

import numpy as np

from .indexed import IndexedDataset

# Megatron's GPTDataset: a final epoch used for less than this fraction is shuffled apart
SEPARATE_FINAL_EPOCH = 0.80


def epochs_needed(tokens_per_epoch: int, seq_len: int, num_samples: int | None) -> int:
    """Megatron's ``_get_num_epochs``: the fewest epochs whose tokens give ``num_samples``
    samples of ``seq_len + 1`` tokens (one epoch when None)."""
    if num_samples is None:
        return 1
    if tokens_per_epoch <= 0:
        raise ValueError("an empty split gives no samples")
    wanted = num_samples * seq_len + 1
    return max(1, -(-wanted // tokens_per_epoch))


def epoch_plan(tokens_per_epoch: int, seq_len: int, num_samples: int | None
               ) -> tuple[int, bool]:
    """(epochs, whether the last is shuffled apart): what, with the documents and the seed,
    fixes the sample order (Megatron's GPTDataset: the last epoch apart when fewer than 80% of
    its samples are used)."""
    epochs = epochs_needed(tokens_per_epoch, seq_len, num_samples)
    if epochs == 1:
        return 1, False
    before_last = ((epochs - 1) * tokens_per_epoch - 1) // seq_len
    per_epoch = (tokens_per_epoch - 1) // seq_len
    return epochs, num_samples - before_last < int(SEPARATE_FINAL_EPOCH * per_epoch)


def document_index(documents: np.ndarray, epochs: int, rng: np.random.RandomState,
                   separate_final_epoch: bool) -> np.ndarray:
    """Megatron's ``_build_document_index``: the documents repeated ``epochs`` times, shuffled
    (the last epoch apart when ``separate_final_epoch``), int32."""
    if not separate_final_epoch or epochs == 1:
        index = np.tile(np.asarray(documents, dtype=np.int32), epochs)
        rng.shuffle(index)
        return index
    first = document_index(documents, epochs - 1, rng, False)
    last = document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def sample_index(lengths: np.ndarray, doc_index: np.ndarray, seq_len: int) -> np.ndarray:
    """``(samples + 1, 2)``: for each sample boundary, the position in ``doc_index`` of the
    document holding the boundary's token and the token's offset in it (Megatron's
    ``build_sample_idx`` with whole samples only and the extra token). Boundary ``i`` is token
    ``i * seq_len`` of the documents concatenated in ``doc_index`` order."""
    lengths = np.asarray(lengths)
    ends = np.cumsum(lengths[doc_index], dtype=np.int64)
    total = int(ends[-1]) if len(ends) else 0
    samples = (total - 1) // seq_len
    if samples < 1:
        raise ValueError(f"{total} tokens make no sample of seq_len + 1 = {seq_len + 1}")
    # boundaries k * seq_len inside document j: k from ceil(begin_j / s) to ceil(end_j / s) - 1,
    # begin_j being end_(j-1): one linear pass, no search (the boundaries are evenly spaced)
    last = ends + (seq_len - 1)
    last //= seq_len
    counts = np.diff(last, prepend=0)
    del last
    index_type = np.int32 if len(doc_index) < 2 ** 31 else np.int64
    pos = np.repeat(np.arange(len(doc_index), dtype=index_type), counts)[:samples + 1]
    del counts
    offsets = np.arange(samples + 1, dtype=np.int64) * seq_len
    offsets -= ends[pos] - lengths[doc_index[pos]]
    dtype = np.int32 if max(len(doc_index), int(lengths.max())) < 2 ** 31 else np.int64
    out = np.empty((samples + 1, 2), dtype=dtype)
    out[:, 0] = pos
    out[:, 1] = offsets
    # Megatron starts the first sample at (0, 0) even when the first document is empty
    out[0] = 0
    return out


def shuffle_index(num_samples: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """Megatron's ``_build_shuffle_index``: ``[0, num_samples)`` shuffled, then ``[num_samples,
    total)`` shuffled apart."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total:
        return first
    last = np.arange(num_samples, total, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


class GPTSamples:
    """The samples of one split of one corpus: ``len(ds)`` samples (whole epochs: at least
    ``num_samples``), ``ds[i]`` the ``seq_len + 1`` token ids of sample ``i`` (int64)."""

    def __init__(self, dataset: IndexedDataset, documents: np.ndarray, *, seq_len: int,
                 num_samples: int | None, seed: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        self.dataset, self.seq_len = dataset, seq_len
        self.documents = np.asarray(documents, dtype=np.int32)
        lengths = dataset.sequence_lengths
        tokens = int(lengths[self.documents].astype(np.int64).sum()) if len(self.documents) else 0
        if tokens < seq_len + 1:
            raise ValueError(f"{dataset.prefix}: documents {_span(self.documents)} hold {tokens} "
                             f"tokens, fewer than one sample of seq_len + 1 = {seq_len + 1}")
        self.epochs, separate = epoch_plan(tokens, seq_len, num_samples)
        before_last = ((self.epochs - 1) * tokens - 1) // seq_len
        rng = np.random.RandomState(seed)
        self.document_index = document_index(self.documents, self.epochs, rng, separate)
        self.sample_index = sample_index(lengths, self.document_index, seq_len)
        n = len(self.sample_index) - 1
        self.shuffle_index = shuffle_index(before_last if separate else n, n, rng)

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} of {len(self)}")
        j = int(self.shuffle_index[i])
        (d0, o0), (d1, o1) = self.sample_index[j], self.sample_index[j + 1]
        d0, o0, d1, o1 = int(d0), int(o0), int(d1), int(o1)
        get, docs = self.dataset.get, self.document_index
        if d0 == d1:
            parts = [get(int(docs[d0]), o0, o1 - o0 + 1)]
        else:
            parts = ([get(int(docs[d0]), o0)] + [get(int(docs[k])) for k in range(d0 + 1, d1)]
                     + [get(int(docs[d1]), 0, o1 + 1)])
        return np.concatenate(parts).astype(np.int64)


def _span(documents: np.ndarray) -> str:
    return f"{int(documents[0])}..{int(documents[-1])}" if len(documents) else "(none)"
