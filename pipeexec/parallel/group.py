"""`GroupView`: this rank's place in one process group of the mesh (tp, cp or ep), a value
passed to every layer that runs that group's collectives, with the timeout their waits take."""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GroupView:
    group: Any                  # ProcessGroup; None when size == 1
    size: int = 1
    rank: int = 0
    timeout: float = 600.0

    @property
    def active(self) -> bool:
        return self.size > 1

    def wait(self, work: Any) -> None:
        """Wait for an async collective of this group, at most ``timeout`` seconds."""
        work.wait(datetime.timedelta(seconds=self.timeout))
