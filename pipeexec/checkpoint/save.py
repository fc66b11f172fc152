"""Saving a checkpoint from every rank, crash-safely, and pruning old ones.

Order of a save (``tag`` = iteration or ``"release"``):

1. rank 0 draws a save id (stored in every file, so files of different saves are never
   mixed silently); every rank captures its RNG states; each data-parallel group gathers them
   on its dp rank 0;
2. dp rank 0 (and cp rank 0: context parallelism does not cut parameters, so every cp rank
   holds the same ones) of every (tp rank, pipeline rank) writes its file atomically
   (temporary name, fsync, rename, fsync dir) into ``iter_XXXXXXX/mp_rank_TT_PPP/``; under
   expert parallelism the ep ranks of dp x cp group's first expert-data-parallel rank, each
   into ``mp_rank_TT_PPP_EEE/`` (its experts; the dense parameters in every one);
3. all ranks meet at a store barrier (which names the ranks that never arrive);
4. global rank 0 points the tracker at ``tag`` (atomically) and prunes checkpoints beyond
   ``keep_last``.

A kill anywhere before 4 leaves the tracker on the previous checkpoint, whose files are
untouched. One case is weaker: a save of the very iteration the tracker already names (a fresh
run started in an old directory without ``--load``) replaces that checkpoint's files one at a
time; a kill in between leaves files of two saves, which the loader refuses (their save ids
differ) instead of mixing them; older iterations stay loadable by number.

Fault injection for tests: ``fault="kill:RANK:TAG:PHASE"`` (or ``raise:...``) makes global rank
RANK SIGKILL itself (or raise) in the save of TAG at PHASE: ``before-rename`` (its temporary
file complete on disk, not yet renamed) or ``before-tracker`` (after the barrier, rank 0 only).
"""
from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .atomic import atomic_write, fsync_dir, remove_stale_temps
from .contents import rank_contents
from .errors import CheckpointError
from .layout import (RELEASE, Tag, every_rank_file, refuse_symlink, saved_iterations,
                     state_file, tag_dir, tag_dir_name)
from .rng import capture_rng_state
from .sync import agree_on_id, gather_to_writer, store_barrier
from .tracker import write_tracker

FAULT_PHASES = ("before-rename", "before-tracker")


@dataclass
class SaveReport:
    tag: Tag
    seconds: float                 # wall time of the whole save on this rank (barrier included)
    write_seconds: float = 0.0     # time spent writing this rank's file (0 if not a writer)
    bytes: int = 0                 # size of this rank's file (0 if not a writer)
    path: str | None = None        # this rank's file (None if not a writer)
    removed: list[int] = field(default_factory=list)   # iterations pruned by keep_last


def parse_fault(spec: str | None) -> tuple[str, int, str, str] | None:
    """``kill|raise:RANK:TAG:PHASE`` -> (kind, rank, tag, phase); None for no fault."""
    if not spec:
        return None
    parts = spec.split(":")
    if len(parts) != 4 or parts[0] not in ("kill", "raise") or parts[3] not in FAULT_PHASES \
            or not parts[1].isdigit():
        raise ValueError(f"bad checkpoint fault {spec!r}: expected kill|raise:RANK:ITERATION:"
                         f"{'|'.join(FAULT_PHASES)}")
    return parts[0], int(parts[1]), parts[2], parts[3]


def _maybe_fault(fault: tuple[str, int, str, str] | None, rank: int, tag: Tag, phase: str) -> None:
    if fault is None:
        return
    kind, f_rank, f_tag, f_phase = fault
    if f_rank == rank and f_tag == str(tag) and f_phase == phase:
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)   # SIGKILL is asynchronous on some systems; never continue the save
        raise CheckpointError(f"injected fault in the save of {tag} at {phase}", field="fault")


def save_checkpoint(trainer, root: str | os.PathLike, *, release: bool = False,
                    keep_last: int | None = None, timeout: float = 600.0, sequence: int = 0,
                    fault: str | None = None, log: Callable[[str], None] | None = None) -> SaveReport:
    """Save ``trainer``'s complete state under ``root``; every rank of the run must call it.

    ``sequence`` numbers the saves of one run (the same on every rank) so that barrier names
    are unique. Returns this rank's `SaveReport`; logs one line on global rank 0.
    """
    t0 = time.perf_counter()
    topo = trainer.topology
    root = Path(root)
    tag: Tag = RELEASE if release else int(trainer.iteration)
    parsed = parse_fault(fault)
    store = getattr(topo, "store", None)
    if topo.world_size > 1 and store is None:
        raise CheckpointError("a multi-rank save needs the topology's store for its barrier",
                              field="store")
    # every rank, before anything is written: no symlinked iteration or rank folder (the save
    # would write, and its cleanup delete, wherever the link points)
    refuse_symlink(tag_dir(root, tag))
    every_rank_file(root, tag)
    if keep_last is not None and not release:
        saved_iterations(root)
    barrier = f"checkpoint/{sequence}/{tag_dir_name(tag)}"
    save_id = agree_on_id(store, barrier + "/id", topo.rank, topo.world_size, timeout)
    rng = capture_rng_state(topo.device)
    gathered = gather_to_writer(rng, topo.dp_group, topo.dp)
    # whole tensors by name: under ZeRO the dp group gathers its shards together
    state = trainer.full_state()
    report = SaveReport(tag, 0.0)
    ep, ep_rank = getattr(topo, "ep", 1), getattr(topo, "ep_rank", 0)
    # the writers: dp x cp rank 0, or with ep the first ep ranks of dp x cp (edp rank 0)
    writer = (topo.dp_rank * getattr(topo, "cp", 1) + getattr(topo, "cp_rank", 0)) < ep
    if writer:
        if gathered is None:
            if ep == 1:
                raise CheckpointError("dp rank 0 did not receive the replicas' RNG states",
                                      field="rng_state")
            gathered = [rng]        # an ep rank's file: its own (the loader reads ep 0's)
        contents = rank_contents(trainer, release=release, state=state)
        contents["save_id"] = save_id
        if not release:
            contents["rng_state"] = gathered
        path = state_file(root, tag, topo.pp_rank, topo.tp_rank, ep_rank if ep > 1 else None)
        refuse_symlink(path.parent)
        remove_stale_temps(path.parent)
        tw = time.perf_counter()
        try:
            size = atomic_write(path, lambda f: torch.save(contents, f),
                                before_rename=lambda tmp: _maybe_fault(parsed, topo.rank, tag,
                                                                       "before-rename"))
        except OSError as e:
            raise CheckpointError(f"cannot write the state file ({e})", path=path) from e
        report.write_seconds, report.bytes, report.path = time.perf_counter() - tw, size, str(path)
    if topo.rank == 0:
        par = trainer.config.plan.parallelism
        remove_other_layouts(root, tag, par.pp, par.tp, par.ep)
    if topo.world_size > 1:
        store_barrier(store, barrier, topo.rank, topo.world_size, timeout)
    if topo.rank == 0:
        _maybe_fault(parsed, topo.rank, tag, "before-tracker")
        write_tracker(root, tag)
        if keep_last is not None and not release:
            report.removed = prune(root, keep_last, int(tag))
    report.seconds = time.perf_counter() - t0
    if topo.rank == 0 and log is not None:
        log(f"checkpoint: saved {tag_dir_name(tag)} to {root} in {report.seconds:.3f} s "
            f"(rank 0 wrote {report.bytes / 2 ** 20:.2f} MiB in {report.write_seconds:.3f} s)"
            + (f"; removed iterations {report.removed}" if report.removed else ""))
    return report


def remove_other_layouts(root: str | os.PathLike, tag: Tag, pp: int, tp: int = 1, ep: int = 1
                         ) -> list[tuple[int, int]]:
    """Delete rank directories ``mp_rank_TT_PPP`` with TT >= tp or PPP >= pp under checkpoint
    ``tag`` (and those of another expert-parallel naming: ``_EEE`` directories when ep == 1,
    plain ones or EEE >= ep when ep > 1); returns their (tp rank, pp rank).

    They can only be left by an earlier save of the same iteration with more pipeline or
    tensor-parallel ranks (an abandoned run, resumed from an earlier checkpoint in another
    layout); no writer of this save touches them.
    """
    stale_dirs = [(t, r, e) for (t, r, e) in every_rank_file(root, tag)
                  if r >= pp or t >= tp or (e is None) != (ep == 1) or (e or 0) >= ep]
    stale = [(t, r) for t, r, _ in stale_dirs]
    for t, r, e in stale_dirs:
        d = state_file(root, tag, r, t, e).parent
        trash = d.with_name(f".deleting-{d.name}-{os.getpid()}")
        os.replace(d, trash)
        shutil.rmtree(trash, ignore_errors=True)
    if stale:
        fsync_dir(tag_dir(root, tag))
    return stale


def prune(root: str | os.PathLike, keep_last: int, current: int) -> list[int]:
    """Delete all but the newest ``keep_last`` iterations at or below ``current``.

    Iterations above ``current`` belong to an abandoned run (resumed from an earlier
    checkpoint): they are left alone, as is the release checkpoint. A directory is first
    renamed to a hidden name, so a kill mid-delete never leaves a half-deleted ``iter_*``.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    root = Path(root)
    older = [i for i in saved_iterations(root) if i <= current]
    doomed = older[:-keep_last] if len(older) > keep_last else []
    for it in doomed:
        src = tag_dir(root, it)
        trash = root / f".deleting-{src.name}-{os.getpid()}"
        os.replace(src, trash)
        shutil.rmtree(trash, ignore_errors=True)
    if doomed:
        fsync_dir(root)
    for stale in root.glob(".deleting-iter_*"):   # left by a kill mid-delete
        shutil.rmtree(stale, ignore_errors=True)
    return doomed
