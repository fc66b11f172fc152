"""The tracker file ``latest_checkpointed_iteration.txt``: which checkpoint is the latest.

It is written last, atomically, after every rank's files are in place, so whatever it names
is complete. Reading it is strict: a missing or garbled tracker is an error naming the file,
never "no checkpoint, start from scratch" (that would silently throw away a run).
"""
from __future__ import annotations

from pathlib import Path

from .atomic import atomic_write_text
from .errors import CheckpointError
from .layout import RELEASE, Tag, tag_dir, tag_dir_name, tracker_path


def read_tracker(root: str | Path) -> Tag:
    """The latest checkpoint's iteration (int) or ``"release"``."""
    root = Path(root)
    path = tracker_path(root)
    if not root.is_dir():
        raise CheckpointError("checkpoint directory does not exist", path=root)
    if not path.is_file():
        raise CheckpointError(
            "no tracker file: this is not a checkpoint directory, or no save ever completed "
            f"(directories present: {sorted(p.name for p in root.iterdir()) or 'none'})", path=path)
    raw = path.read_bytes()
    try:
        text = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"tracker holds non-text bytes {raw[:32]!r}; expected an "
                              f"iteration number or {RELEASE!r}", path=path) from None
    if text == RELEASE:
        return RELEASE
    if not text.isdigit():
        raise CheckpointError(f"tracker holds {text[:64]!r}; expected a non-negative iteration "
                              f"number or {RELEASE!r}", path=path)
    return int(text)


def write_tracker(root: str | Path, tag: Tag) -> None:
    """Point the tracker at ``tag`` (atomically); its directory must already exist."""
    name = tag_dir_name(tag)      # validates the tag
    if not tag_dir(root, tag).is_dir():
        raise CheckpointError(f"refusing to point the tracker at missing {name}", path=tag_dir(root, tag))
    atomic_write_text(tracker_path(root), f"{tag}\n")
