"""Where a checkpoint's files live: Megatron-LM's directory layout.

```
DIR/latest_checkpointed_iteration.txt           "50" or "release": the tracker, written last
DIR/iter_0000050/mp_rank_{tp_rank:02d}_{pp_rank:03d}/model_optim_rng.pt
DIR/release/mp_rank_{tp_rank:02d}_{pp_rank:03d}/model_optim_rng.pt
DIR/iter_0000050/mp_rank_{tp_rank:02d}_{pp_rank:03d}_{ep_rank:03d}/model_optim_rng.pt   (ep > 1)
```

One file per (tensor-parallel rank, pipeline rank), written by data-parallel rank 0 there (the
replicas hold the same weights); a tensor-parallel rank's file holds its shards, each with the
`ShardSpec` that cuts it (``layout.shards``), so a loader at another tp puts them back together
and cuts them again. Under expert parallelism (ep > 1) each (tp, pp, ep) rank writes one, in
Megatron's expert-parallel name ``mp_rank_TT_PPP_EEE``: its dense parameters (the same in every
ep rank's file) and its own experts, each expert tensor listed in ``layout.experts`` (its dim 0
is this ep rank's E / ep experts, in order). The pipeline suffix is written even when pp == 1, so a path never depends
on the layout.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from .errors import CheckpointError

TRACKER_NAME = "latest_checkpointed_iteration.txt"
STATE_FILE_NAME = "model_optim_rng.pt"
RELEASE = "release"
CHECKPOINT_VERSION = 1          # bump when the file's contents change incompatibly

_ITER_RE = re.compile(r"^iter_(\d{7,})$")
_RANK_RE = re.compile(r"^mp_rank_(\d{2,})_(\d{3,})(?:_(\d{3,}))?$")

Tag = int | str                 # an iteration, or RELEASE


def tag_dir_name(tag: Tag) -> str:
    """``iter_0000050`` for iteration 50, ``release`` for the release checkpoint."""
    if tag == RELEASE:
        return RELEASE
    if not isinstance(tag, int) or isinstance(tag, bool) or tag < 0:
        raise ValueError(f"a checkpoint iteration must be a non-negative integer or "
                         f"{RELEASE!r}, got {tag!r}")
    return f"iter_{tag:07d}"


def tracker_path(root: str | Path) -> Path:
    return Path(root) / TRACKER_NAME


def tag_dir(root: str | Path, tag: Tag) -> Path:
    return Path(root) / tag_dir_name(tag)


def rank_dir_name(pp_rank: int, tp_rank: int = 0, ep_rank: int | None = None) -> str:
    """``mp_rank_TT_PPP``; with expert parallelism (``ep_rank`` given) ``mp_rank_TT_PPP_EEE``."""
    base = f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return base if ep_rank is None else f"{base}_{ep_rank:03d}"


def state_file(root: str | Path, tag: Tag, pp_rank: int, tp_rank: int = 0,
               ep_rank: int | None = None) -> Path:
    """The file (tensor-parallel rank ``tp_rank``, pipeline rank ``pp_rank``, expert-parallel
    rank ``ep_rank`` when ep > 1) writes for checkpoint ``tag``."""
    return tag_dir(root, tag) / rank_dir_name(pp_rank, tp_rank, ep_rank) / STATE_FILE_NAME


def chunk_key(chunk: int, vpp: int) -> str:
    """Megatron's key of a chunk's model state: ``model`` when vpp == 1, else ``model0``..."""
    return "model" if vpp == 1 else f"model{chunk}"


def refuse_symlink(path: str | Path) -> Path:
    """``path`` itself, unless it is a symbolic link: an iteration or rank folder of a
    checkpoint must be a real folder inside it. Through a link a save would write its files,
    remove stale temporaries, and prune or replace old layouts in whatever folder the link
    names, outside the checkpoint; a load would read files it does not own. The checkpoint
    folder itself (``--save DIR``) may be a link: the user names it."""
    path = Path(path)
    if path.is_symlink():
        raise CheckpointError(
            f"is a symbolic link (to {os.readlink(path)!r}); a checkpoint's iteration and rank "
            "folders must be real folders inside it, so that saving and pruning never write or "
            "delete outside it: replace the link with a copy of the folder", path=path,
            field="layout")
    return path


def saved_iterations(root: str | Path) -> list[int]:
    """Iterations with a directory under ``root`` (complete or not), ascending; a symlinked
    one is refused (`refuse_symlink`)."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for child in root.iterdir():
        m = _ITER_RE.match(child.name)
        if m and refuse_symlink(child).is_dir():
            out.append(int(m.group(1)))
    return sorted(out)


def rank_files(root: str | Path, tag: Tag) -> dict[int, Path]:
    """pp rank -> state file of tensor-parallel rank 0, for every such rank directory of
    checkpoint ``tag`` holding one (`all_rank_files`: every tp rank's)."""
    return {pp: path for (tp, pp), path in all_rank_files(root, tag).items() if tp == 0}


def all_rank_files(root: str | Path, tag: Tag) -> dict[tuple[int, int], Path]:
    """(tp rank, pp rank) -> state file, for every rank directory of checkpoint ``tag``
    (under expert parallelism, ep rank 0's; `expert_rank_files` has every ep rank's)."""
    return {(t, p): path for (t, p, e), path in every_rank_file(root, tag).items()
            if e in (None, 0)}


def expert_rank_files(root: str | Path, tag: Tag) -> dict[tuple[int, int, int], Path]:
    """(tp rank, pp rank, ep rank) -> state file of every ``mp_rank_TT_PPP_EEE`` directory."""
    return {(t, p, e): path for (t, p, e), path in every_rank_file(root, tag).items()
            if e is not None}


def every_rank_file(root: str | Path, tag: Tag) -> dict[tuple[int, int, int | None], Path]:
    """(tp rank, pp rank, ep rank or None) -> state file, for every rank directory (a
    symlinked iteration or rank folder is refused: `refuse_symlink`)."""
    d = refuse_symlink(tag_dir(root, tag))
    out: dict[tuple[int, int, int | None], Path] = {}
    if not d.is_dir():
        return out
    for child in d.iterdir():
        m = _RANK_RE.match(child.name)
        if m and refuse_symlink(child).is_dir() and (child / STATE_FILE_NAME).is_file():
            e = None if m.group(3) is None else int(m.group(3))
            out[(int(m.group(1)), int(m.group(2)), e)] = child / STATE_FILE_NAME
    return dict(sorted(out.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 0)))
