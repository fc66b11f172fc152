"""Megatron's indexed dataset, read and written: ``PREFIX.bin`` holds every sequence's token
ids back to back, ``PREFIX.idx`` says where each starts.

The index, little-endian, as Megatron-Core's ``indexed_dataset.py`` writes it::

    b"MMIDIDX\\x00\\x00"        9 bytes, the magic
    version                   uint64, 1
    dtype code                uint8 (Megatron's DType: 1 uint8 ... 4 int32 ... 8 uint16)
    sequence count S          uint64
    document count D          uint64 (document indices, the leading 0 included)
    sequence lengths          S x int32, tokens
    sequence pointers         S x int64, byte offsets into the .bin
    document indices          D x int64, the sequence index that ends each document

Reading memory-maps both files: nothing is read into memory that is not asked for. Every
check that the files agree costs O(1) (sizes from the header, the last pointer), so a corpus
of any size is checked before a run starts. Torch-free (numpy only).
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8          # 34

# Megatron's DType codes (megatron/core/datasets/indexed_dataset.py)
DTYPE_CODES: dict[int, type] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32,
                                5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}


class IndexedDatasetError(ValueError):
    """A .bin / .idx pair that cannot be read, naming the file and what disagrees."""


def optimal_dtype(vocab_size: int | None) -> type:
    """Megatron's ``DType.optimal_dtype``: uint16 for a vocabulary under 65500 ids, else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def idx_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{prefix}.idx")


def bin_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{prefix}.bin")


@dataclass(frozen=True)
class IndexHeader:
    """The fixed part of a .idx file."""

    dtype: type
    sequence_count: int
    document_count: int


def read_header(path: Path) -> IndexHeader:
    """The header of the .idx file ``path``, checked against the file's size."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
    except OSError as exc:
        raise IndexedDatasetError(f"{path}: cannot read the index ({exc.strerror})") from None
    if len(head) < HEADER_BYTES or head[:len(MAGIC)] != MAGIC:
        raise IndexedDatasetError(f"{path}: not a Megatron indexed dataset index (no MMIDIDX "
                                  f"header in its first {HEADER_BYTES} bytes)")
    version, = struct.unpack("<Q", head[9:17])
    if version != VERSION:
        raise IndexedDatasetError(f"{path}: index version {version}, this reader knows {VERSION}")
    code = head[17]
    if code not in DTYPE_CODES:
        raise IndexedDatasetError(f"{path}: unknown token dtype code {code} (Megatron's codes "
                                  f"are {sorted(DTYPE_CODES)})")
    sequences, documents = struct.unpack("<QQ", head[18:34])
    want = HEADER_BYTES + sequences * (4 + 8) + documents * 8
    size = path.stat().st_size
    # a multimodal index carries one int8 mode per sequence after the document indices
    if size not in (want, want + sequences):
        raise IndexedDatasetError(
            f"{path}: truncated or mismatched index: the header counts {sequences} sequences "
            f"and {documents} document indices, which take {want} bytes, the file has {size}")
    return IndexHeader(DTYPE_CODES[code], sequences, documents)


class IndexedDataset:
    """A memory-mapped ``PREFIX.bin`` / ``PREFIX.idx`` pair: ``len`` sequences, ``ds[i]`` the
    token ids of sequence ``i``, ``get(i, offset, length)`` a piece of one, ``sequence_lengths``
    and ``document_indices`` as Megatron's reader names them."""

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.prefix = str(prefix)
        ipath, bpath = idx_path(prefix), bin_path(prefix)
        if not ipath.is_file():
            raise IndexedDatasetError(f"{ipath}: no such index (the data path names a prefix: "
                                      f"PREFIX.idx and PREFIX.bin, e.g. as preprocess-data "
                                      "writes them)")
        if not bpath.is_file():
            raise IndexedDatasetError(f"{bpath}: missing beside its index {ipath}")
        header = read_header(ipath)
        self.dtype = header.dtype
        s, d = header.sequence_count, header.document_count
        index = np.memmap(ipath, mode="r", dtype=np.uint8)
        o = HEADER_BYTES
        self.sequence_lengths = index[o:o + 4 * s].view(np.int32)
        self.sequence_pointers = index[o + 4 * s:o + 12 * s].view(np.int64)
        self.document_indices = index[o + 12 * s:o + 12 * s + 8 * d].view(np.int64)
        item = np.dtype(self.dtype).itemsize
        end = int(self.sequence_pointers[-1]) + item * int(self.sequence_lengths[-1]) if s else 0
        size = bpath.stat().st_size
        if size != end:
            raise IndexedDatasetError(
                f"{bpath}: {size} bytes, but its index {ipath} places {s} sequences ending at "
                f"byte {end} ({np.dtype(self.dtype).name} tokens): the .bin and the .idx do not "
                "belong together (or one is truncated); write them again")
        if d < 1 or self.document_indices[0] != 0 or self.document_indices[-1] != s:
            raise IndexedDatasetError(
                f"{ipath}: document indices must run from 0 to the sequence count {s}, got "
                f"{int(self.document_indices[0]) if d else None} .. "
                f"{int(self.document_indices[-1]) if d else None}")
        self._tokens = (np.memmap(bpath, mode="r", dtype=self.dtype) if size else
                        np.zeros(0, dtype=self.dtype))

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def document_count(self) -> int:
        return len(self.document_indices) - 1

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``offset .. offset + length`` of sequence ``i`` (to its end when None), a
        view into the memory map."""
        start = int(self.sequence_pointers[i]) // np.dtype(self.dtype).itemsize + offset
        stop = (start - offset + int(self.sequence_lengths[i]) if length is None
                else start + length)
        return self._tokens[start:stop]

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(int(i))


class IndexedDatasetWriter:
    """Writes ``PREFIX.bin`` and ``PREFIX.idx`` as Megatron's ``IndexedDatasetBuilder`` does:
    `add_document` appends one document of one or more sequences; `finish` writes the index.
    The files are written under temporary names and renamed into place by `finish`, so a
    reader never sees half a dataset."""

    def __init__(self, prefix: str | os.PathLike, dtype: type) -> None:
        if np.dtype(dtype) not in CODE_OF:
            raise ValueError(f"token dtype {dtype} has no Megatron code")
        self.prefix, self.dtype = str(prefix), np.dtype(dtype)
        suffix = f".tmp{os.getpid()}"
        self._bin_tmp = Path(f"{bin_path(prefix)}{suffix}")
        self._idx_tmp = Path(f"{idx_path(prefix)}{suffix}")
        self._bin = open(self._bin_tmp, "wb")
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]

    def add_document(self, tokens: np.ndarray | list[int], lengths: list[int] | None = None) -> None:
        """One document: ``tokens`` cut into sequences of ``lengths`` (default: one sequence;
        an empty document adds none, as Megatron's preprocessing does)."""
        arr = np.asarray(tokens)
        if arr.size and (arr.min() < 0 or (self.dtype.kind in "ui"
                                           and arr.max() > np.iinfo(self.dtype).max)):
            raise ValueError(f"token ids {int(arr.min())}..{int(arr.max())} do not fit "
                             f"{self.dtype.name}")
        lengths = ([arr.size] if arr.size else []) if lengths is None else list(lengths)
        if sum(lengths) != arr.size:
            raise ValueError(f"sequence lengths {lengths} do not sum to the {arr.size} tokens")
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes(order="C"))
        self.sequence_lengths.extend(int(n) for n in lengths)
        self.document_indices.append(len(self.sequence_lengths))

    def finish(self) -> None:
        """Write the index and move both files into place (.bin first: a reader opens by the
        .idx)."""
        self._bin.close()
        lengths = np.asarray(self.sequence_lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths):
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        with open(self._idx_tmp, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<Q", VERSION))
            f.write(struct.pack("<B", CODE_OF[self.dtype]))
            f.write(struct.pack("<Q", len(lengths)))
            f.write(struct.pack("<Q", len(self.document_indices)))
            f.write(lengths.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(np.asarray(self.document_indices, dtype=np.int64).tobytes(order="C"))
        os.replace(self._bin_tmp, bin_path(self.prefix))
        os.replace(self._idx_tmp, idx_path(self.prefix))

    def abort(self) -> None:
        """Drop the temporary files (a failed run leaves nothing behind)."""
        self._bin.close()
        for p in (self._bin_tmp, self._idx_tmp):
            p.unlink(missing_ok=True)
