"""Crash-safe file writes: temporary name, fsync, rename, fsync the directory.

A reader sees either the old file or the complete new one, never a prefix: the bytes go to a
hidden temporary file in the same directory (same filesystem, so the rename is atomic), are
flushed to disk, and only then is the file renamed into place; the directory is fsynced so the
rename itself survives a power cut. A process killed mid-write leaves at most a stale
``.NAME.tmp-PID`` file, which the next save in that directory removes.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

TMP_MARK = ".tmp-"


def fsync_dir(path: str | Path) -> None:
    """Make a directory's entries (renames, new files) durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: str | Path) -> None:
    """``mkdir -p`` that fsyncs the parent of every directory it creates."""
    path = Path(path)
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:   # another writer created it meanwhile
            pass
        fsync_dir(d.parent)


def temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}")


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None], *,
                 before_rename: Callable[[Path], None] | None = None) -> int:
    """Write ``path`` atomically; ``write(f)`` fills the open temporary file.

    ``before_rename(tmp)`` runs once the temporary file is complete and on disk, just before
    the rename: the place where a crash is worst, so tests inject faults there. Returns the
    number of bytes written.
    """
    path = Path(path)
    make_dirs(path.parent)
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        if before_rename is not None:
            before_rename(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return size


def atomic_write_text(path: str | Path, text: str) -> int:
    data = text.encode()
    return atomic_write(path, lambda f: f.write(data))


def remove_stale_temps(directory: str | Path) -> list[Path]:
    """Delete temporary files left by killed writers in ``directory`` (not recursive)."""
    directory = Path(directory)
    removed = []
    if directory.is_dir():
        for child in directory.iterdir():
            if child.name.startswith(".") and TMP_MARK in child.name and child.is_file():
                child.unlink(missing_ok=True)
                removed.append(child)
    return removed
