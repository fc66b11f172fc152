"""The one exception type of checkpointing: it names the file and the field at fault.

A checkpoint that cannot be used must stop the run with a message a user can act on (which
file, which key or config field, what was expected), never fall back to a random init.
"""
from __future__ import annotations

import os


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or loaded; ``path`` and ``field`` say where."""

    def __init__(self, message: str, *, path: str | os.PathLike | None = None,
                 field: str | None = None) -> None:
        self.path = None if path is None else os.fspath(path)
        self.field = field
        prefix = f"{self.path}: " if self.path is not None else ""
        super().__init__(prefix + message)
