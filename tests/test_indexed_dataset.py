"""Megatron's indexed dataset format (pipeexec/datasets/indexed.py): the bytes of the index as
Megatron-Core's ``_IndexWriter`` lays them out (transcribed field by field below), Megatron-Core's
own ``IndexedDataset`` reading our files token for token and our reader reading files written
by its ``IndexedDatasetBuilder`` (skipped, with the reason, where megatron-core does not
import), and every broken pair named with its file and counts."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from pipeexec.datasets.indexed import (IndexedDataset, IndexedDatasetError,
                                       IndexedDatasetWriter, optimal_dtype)


pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


def _megatron():
    try:
        from megatron.core.datasets import indexed_dataset
    except Exception as exc:                 # not installed, or its imports fail here
        pytest.skip(f"megatron-core does not import here: {type(exc).__name__}: {exc}")
    return indexed_dataset


DOCS = [[5, 6, 7], [], [1], [300, 2, 2, 9, 65499]]


def write(prefix, docs=DOCS, dtype=np.uint16):
    w = IndexedDatasetWriter(prefix, dtype)
    for d in docs:
        w.add_document(np.asarray(d, dtype=np.int64))
    w.finish()
    return str(prefix)


def test_the_index_holds_megatrons_fields_in_megatrons_order(tmp_path):
    prefix = write(tmp_path / "ds")
    raw = (tmp_path / "ds.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, code, sequences, documents = struct.unpack("<QBQQ", raw[9:34])
    # 3 non-empty documents -> 3 sequences; document indices 0, 1, 1, 2, 3 (the empty one
    # ends where the one before it does)
    assert (version, code, sequences, documents) == (1, 8, 3, 5)
    lengths = np.frombuffer(raw, np.int32, 3, 34)
    pointers = np.frombuffer(raw, np.int64, 3, 34 + 12)
    doc_idx = np.frombuffer(raw, np.int64, 5, 34 + 12 + 24)
    assert lengths.tolist() == [3, 1, 5] and pointers.tolist() == [0, 6, 8]
    assert doc_idx.tolist() == [0, 1, 1, 2, 3] and len(raw) == 34 + 12 + 24 + 40
    assert (tmp_path / "ds.bin").read_bytes() == np.array(
        [5, 6, 7, 1, 300, 2, 2, 9, 65499], dtype="<u2").tobytes()
    ds = IndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(len(ds))] == [[5, 6, 7], [1], [300, 2, 2, 9, 65499]]
    assert ds.get(2, 1, 3).tolist() == [2, 2, 9] and ds.document_count == 4
    assert not list(tmp_path.glob("*.tmp*"))           # written under temporary names, renamed


def test_token_dtype_is_megatrons_optimal_dtype():
    # Megatron's DType.optimal_dtype: uint16 below 65500 ids, else int32
    assert [optimal_dtype(v) for v in (256, 65499, 65500, 128256, None)] == [
        np.uint16, np.uint16, np.int32, np.int32, np.int32]
    try:
        from megatron.core.datasets.indexed_dataset import DType
    except Exception:
        return
    for v in (256, 50257, 65499, 65500, 151936):
        assert optimal_dtype(v) is DType.optimal_dtype(v)


def test_megatron_core_reads_our_files_token_for_token(tmp_path):
    mi = _megatron()
    rng = np.random.default_rng(0)
    for dtype in (np.uint16, np.int32):
        docs = [rng.integers(0, 60000, rng.integers(0, 40)).tolist() for _ in range(50)]
        prefix = write(tmp_path / f"ours_{np.dtype(dtype).name}", docs, dtype)
        theirs = mi.IndexedDataset(prefix)
        assert theirs.index.dtype == dtype
        want = [d for d in docs if d]
        assert len(theirs) == len(want)
        for i, d in enumerate(want):
            assert theirs[i].tolist() == d
        assert theirs.document_indices.tolist() == IndexedDataset(prefix).document_indices.tolist()


def test_we_read_files_megatron_core_writes(tmp_path):
    mi = _megatron()
    import torch

    rng = np.random.default_rng(1)
    prefix = str(tmp_path / "theirs")
    builder = mi.IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    docs = []
    for _ in range(30):
        sentences = [rng.integers(0, 100000, rng.integers(1, 9)).tolist()
                     for _ in range(rng.integers(1, 4))]
        docs.append(sentences)
        builder.add_document(torch.tensor(sum(sentences, [])), [len(s) for s in sentences])
    builder.finalize(prefix + ".idx")
    ours = IndexedDataset(prefix)
    flat = [s for d in docs for s in d]
    assert ours.dtype is np.int32 and len(ours) == len(flat)
    assert [ours[i].tolist() for i in range(len(ours))] == flat
    assert ours.document_indices.tolist() == np.cumsum([0] + [len(d) for d in docs]).tolist()


def test_broken_pairs_are_named_with_the_file_and_the_counts(tmp_path):
    prefix = write(tmp_path / "ds")
    (tmp_path / "ds.bin").rename(tmp_path / "moved.bin")
    with pytest.raises(IndexedDatasetError, match=r"ds\.bin: missing beside its index .*ds\.idx"):
        IndexedDataset(prefix)
    (tmp_path / "moved.bin").write_bytes((tmp_path / "moved.bin").read_bytes()[:10])
    (tmp_path / "moved.bin").rename(tmp_path / "ds.bin")
    with pytest.raises(IndexedDatasetError,
                       match=r"ds\.bin: 10 bytes, but its index .* places 3 sequences ending at "
                             r"byte 18 \(uint16 tokens\)"):
        IndexedDataset(prefix)
    raw = (tmp_path / "ds.idx").read_bytes()
    (tmp_path / "ds.idx").write_bytes(raw[:-8])
    with pytest.raises(IndexedDatasetError, match=r"ds\.idx: truncated or mismatched index: the "
                       r"header counts 3 sequences and 5 document indices, which take 110 "
                       r"bytes, the file has 102"):
        IndexedDataset(prefix)
    (tmp_path / "ds.idx").write_bytes(b"{}" + raw[2:])
    with pytest.raises(IndexedDatasetError, match="not a Megatron indexed dataset index"):
        IndexedDataset(prefix)
    with pytest.raises(IndexedDatasetError, match=r"nope\.idx: no such index"):
        IndexedDataset(tmp_path / "nope")
