"""Reading a checkpoint: verified files, and lookups by global name across all of them.

`read_state_file` checks a file before trusting it: a truncated file has no zip central
directory, a flipped bit fails the CRC-32 that ``torch.save`` stores for every record (which
``torch.load`` itself does not check; a file read for its header only has its pickle record
checked), and a file without the expected top-level keys is named
with the key. Loading uses ``weights_only=True``: a checkpoint is data, never code.

`CheckpointReader` opens every rank file of one checkpoint lazily (``mmap``: a rank reads only
the tensors it asks for) and answers "the tensors of these parameter names" whichever rank
wrote them: this is what makes a checkpoint loadable into a different layout.
"""
from __future__ import annotations

import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

import pipesim
from pipesim.schedule.io import schedule_from_dict

from .contents import layer_of, model_chunks, saved_stages, stage_layer_range
from .errors import CheckpointError
from .layout import (CHECKPOINT_VERSION, RELEASE, Tag, all_rank_files, expert_rank_files,
                     saved_iterations, state_file, tag_dir, tag_dir_name)
from .tracker import read_tracker

REQUIRED_KEYS = ("checkpoint_version", "iteration", "release", "config", "layout")
TRAINING_KEYS = ("optimizer", "opt_param_scheduler", "loss_scaler", "rng_state", "consumed_samples")


def verify_file(path: str | Path, *, pickle_only: bool = False) -> None:
    """Raise CheckpointError unless ``path`` is a complete, uncorrupted torch zip file.

    ``pickle_only``: CRC-check only the pickle record (``data.pkl``: the object structure and
    every non-tensor value, small), enough to read the file's header safely without a pass
    over its tensors.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError("state file is missing", path=path)
    try:
        with zipfile.ZipFile(path) as z:
            bad = _bad_pickle_record(z) if pickle_only else z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise CheckpointError(f"state file is truncated or not a torch checkpoint ({e}); "
                              f"size {path.stat().st_size} bytes", path=path) from e
    if bad is not None:
        raise CheckpointError(f"state file is corrupt: record {bad!r} fails its CRC-32 check",
                              path=path, field=bad)


def _bad_pickle_record(z: zipfile.ZipFile) -> str | None:
    """Name of the pickle record if it fails its CRC-32 (zipfile checks it on a full read)."""
    for name in z.namelist():
        if name == "data.pkl" or name.endswith("/data.pkl"):
            try:
                z.read(name)
            except zipfile.BadZipFile:
                return name
    return None


def read_state_file(path: str | Path, *, verify: bool = True, mmap: bool = True) -> dict[str, Any]:
    """Load one rank file (tensors on CPU), after verifying it; check its top-level keys."""
    path = Path(path)
    if verify:
        verify_file(path)
    try:
        contents = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:   # noqa: BLE001  (any unpickling failure is a corrupt checkpoint)
        raise CheckpointError(f"cannot read state file ({type(e).__name__}: {e})", path=path) from e
    if not isinstance(contents, dict):
        raise CheckpointError(f"state file holds a {type(contents).__name__}, not a dict", path=path)
    for key in REQUIRED_KEYS:
        if key not in contents:
            raise CheckpointError(f"state file lacks the key {key!r}", path=path, field=key)
    version = contents["checkpoint_version"]
    if version != CHECKPOINT_VERSION:
        raise CheckpointError(f"checkpoint_version {version!r} is not the supported "
                              f"{CHECKPOINT_VERSION}", path=path, field="checkpoint_version")
    if not contents["release"]:
        for key in TRAINING_KEYS:
            if key not in contents:
                raise CheckpointError(f"state file lacks the key {key!r}", path=path, field=key)
    return contents


def missing_checkpoint(root: Path, tag: Tag, *, asked: bool) -> str:
    """Why checkpoint ``tag`` cannot be read, with the iterations ``root`` does hold."""
    have = saved_iterations(root)
    listed = ", ".join(map(str, have)) if have else "none"
    if (root / tag_dir_name(RELEASE)).is_dir():
        listed += f" and {RELEASE!r}"
    if asked:
        return (f"no checkpoint of iteration {tag!r} in {root} (iterations saved there: "
                f"{listed}; --ckpt-step picks one of them, without it the latest is loaded)")
    return (f"the tracker names checkpoint {tag!r} but its directory is missing (iterations "
            f"saved there: {listed})")


class CheckpointReader:
    """All rank files of one checkpoint (``tag``: an iteration, ``"release"``, or None for the
    tracker's), opened on demand; ``home`` is the pipeline rank whose file to read first."""

    def __init__(self, root: str | Path, tag: Tag | None = None, *, verify: bool = True,
                 home: int = 0) -> None:
        self.root = Path(root)
        self.tag: Tag = read_tracker(self.root) if tag is None else tag
        self.verify = verify
        self.dir = tag_dir(self.root, self.tag)
        if not self.dir.is_dir():
            raise CheckpointError(missing_checkpoint(self.root, self.tag, asked=tag is not None),
                                  path=self.dir)
        self.all_paths = all_rank_files(self.root, self.tag)
        self.paths = {pp: path for (tp, pp), path in self.all_paths.items() if tp == 0}
        if not self.paths:
            raise CheckpointError("checkpoint directory holds no rank files "
                                  "(mp_rank_TT_PPP/model_optim_rng.pt)", path=self.dir)
        self._files: dict[int, dict[str, Any]] = {}
        self._tp_files: dict[tuple[int, int], dict[str, Any]] = {}
        self._placement: list[list[int]] | None = None
        # The header (layout, config) is read from the caller's own file when there is one,
        # so a rank never reads (and CRC-checks) a file it does not need.
        first = self.file(home if home in self.paths else min(self.paths))
        self.layout: dict[str, Any] = first["layout"]
        self.config: dict[str, Any] = first["config"]
        self.iteration: int = int(first["iteration"])
        self.release: bool = bool(first["release"])
        if self.tag != RELEASE and self.iteration != self.tag:
            raise CheckpointError(f"file holds iteration {self.iteration}, its directory says "
                                  f"{self.tag}", path=self.opened()[0], field="iteration")
        pp = int(self.layout["pp"])
        for r in range(pp):
            if r not in self.paths:
                raise CheckpointError(f"rank file of pipeline rank {r} is missing (the checkpoint "
                                      f"was written with pp={pp})", path=state_file(self.root, self.tag, r))
        extra = sorted(set(self.paths) - set(range(pp)))
        if extra:
            raise CheckpointError(f"unexpected rank directories for pipeline ranks {extra} "
                                  f"(the checkpoint was written with pp={pp})", path=self.dir)
        tp = self.tp
        for t in range(1, tp):
            for r in range(pp):
                if (t, r) not in self.all_paths:
                    raise CheckpointError(f"rank file of tensor-parallel rank {t}, pipeline rank "
                                          f"{r} is missing (the checkpoint was written with "
                                          f"tp={tp}, pp={pp})",
                                          path=state_file(self.root, self.tag, r, t))
        extra_tp = sorted({t for t, _ in self.all_paths} - set(range(tp)))
        if extra_tp:
            raise CheckpointError(f"unexpected rank directories for tensor-parallel ranks "
                                  f"{extra_tp} (the checkpoint was written with tp={tp})",
                                  path=self.dir)
        # expert parallelism: one file per (tp, pp, ep) rank, mp_rank_TT_PPP_EEE
        self.ep_paths = expert_rank_files(self.root, self.tag)
        self._ep_files: dict[tuple[int, int, int], dict[str, Any]] = {}
        ep = self.ep
        for t in range(tp):
            for r in range(pp):
                for e in range(ep if ep > 1 else 0):
                    if (t, r, e) not in self.ep_paths:
                        raise CheckpointError(
                            f"rank file of tensor-parallel rank {t}, pipeline rank {r}, "
                            f"expert-parallel rank {e} is missing (the checkpoint was written "
                            f"with tp={tp}, pp={pp}, ep={ep})",
                            path=state_file(self.root, self.tag, r, t, e))
        extra_ep = sorted({e for _, _, e in self.ep_paths} - set(range(ep if ep > 1 else 0)))
        if extra_ep:
            raise CheckpointError(f"unexpected rank directories for expert-parallel ranks "
                                  f"{extra_ep} (the checkpoint was written with ep={ep})",
                                  path=self.dir)

    @property
    def pp(self) -> int:
        return int(self.layout["pp"])

    @property
    def tp(self) -> int:
        """The checkpoint's tensor-parallel size (1 for files written before tp)."""
        return int(self.layout.get("tp", 1))

    @property
    def ep(self) -> int:
        """The checkpoint's expert-parallel size (1 for files written before ep)."""
        return int(self.layout.get("ep", 1))

    def expert_file(self, pp_rank: int, tp_rank: int, ep_rank: int) -> dict[str, Any]:
        """The file of (``tp_rank``, ``pp_rank``, ``ep_rank``); ep rank 0's is `shard_file`'s."""
        if ep_rank == 0:
            return self.shard_file(pp_rank, tp_rank)
        key = (tp_rank, pp_rank, ep_rank)
        if key not in self._ep_files:
            path = self.ep_paths.get(key)
            if path is None:
                raise CheckpointError(f"no rank file for tp rank {tp_rank}, pp rank {pp_rank}, "
                                      f"ep rank {ep_rank}",
                                      path=state_file(self.root, self.tag, pp_rank, tp_rank,
                                                      ep_rank))
            f = read_state_file(path, verify=self.verify)
            lay = f["layout"]
            got = (int(lay.get("tp_rank", 0)), int(lay["pp_rank"]), int(lay.get("ep_rank", 0)))
            if got != key:
                raise CheckpointError(f"file says it is (tp, pp, ep) rank {got}; its directory "
                                      f"says {key}", path=path, field="layout.ep_rank")
            if f.get("save_id") != self.file(pp_rank).get("save_id"):
                raise CheckpointError("save_id differs from the other rank files': files of "
                                      "different saves are mixed", path=path, field="save_id")
            self._ep_files[key] = f
        return self._ep_files[key]

    def shard_file(self, pp_rank: int, tp_rank: int) -> dict[str, Any]:
        """The file of (``tp_rank``, ``pp_rank``); tp rank 0's is `file`'s."""
        if tp_rank == 0:
            return self.file(pp_rank)
        key = (tp_rank, pp_rank)
        if key not in self._tp_files:
            path = self.all_paths.get(key)
            if path is None:
                raise CheckpointError(f"no rank file for tensor-parallel rank {tp_rank}, pipeline "
                                      f"rank {pp_rank}", path=state_file(self.root, self.tag,
                                                                         pp_rank, tp_rank))
            f = read_state_file(path, verify=self.verify)
            lay = f["layout"]
            if (int(lay.get("tp_rank", 0)), int(lay["pp_rank"])) != key:
                raise CheckpointError(f"file says it is tp rank {lay.get('tp_rank', 0)}, pp rank "
                                      f"{lay['pp_rank']}; its directory says {tp_rank}, {pp_rank}",
                                      path=path, field="layout.tp_rank")
            if f.get("save_id") != self.file(pp_rank).get("save_id"):
                raise CheckpointError("save_id differs from the other rank files': files of "
                                      "different saves are mixed", path=path, field="save_id")
            self._tp_files[key] = f
        return self._tp_files[key]

    def whole(self, pp_rank: int, name: str, pick) -> Any:
        """The whole tensor of ``name`` held by ``pp_rank``'s files: tp rank 0's, or every tp
        rank's piece (``pick(file)`` reads it) put back together by its recorded `ShardSpec`;
        an expert tensor (``layout.experts``) is every ep rank's experts, in ep-rank order."""
        from ..parallel.sharding import ShardSpec, unshard
        f = self.file(pp_rank)
        spec = f["layout"].get("shards", {}).get(name)
        expert = self.ep > 1 and name in f["layout"].get("experts", ())

        def over_tp(e: int) -> Any:
            if spec is None or self.tp == 1:
                return pick(self.expert_file(pp_rank, 0, e))
            return unshard([pick(self.expert_file(pp_rank, t, e)) for t in range(self.tp)],
                           ShardSpec.from_dict(spec))
        if not expert:
            return over_tp(0)
        return torch.cat([over_tp(e) for e in range(self.ep)])

    def opened(self) -> list[str]:
        """Paths of the rank files read so far."""
        return [str(self.paths[r]) for r in sorted(self._files)]

    def path(self, pp_rank: int) -> Path:
        return self.paths[pp_rank]

    def file(self, pp_rank: int) -> dict[str, Any]:
        if pp_rank not in self._files:
            if pp_rank not in self.paths:
                raise CheckpointError(f"no rank file for pipeline rank {pp_rank}",
                                      path=state_file(self.root, self.tag, pp_rank))
            f = read_state_file(self.paths[pp_rank], verify=self.verify)
            if f["layout"]["pp_rank"] != pp_rank:
                raise CheckpointError(f"file says it is pp rank {f['layout']['pp_rank']}, its "
                                      f"directory says {pp_rank}", path=self.paths[pp_rank],
                                      field="layout.pp_rank")
            if self._files:
                first = next(iter(self._files.values()))
                for key in ("iteration", "release", "save_id"):
                    if f.get(key) != first.get(key):
                        raise CheckpointError(f"{key} {f.get(key)!r} differs from the other rank "
                                              f"files' {first.get(key)!r}: files of different saves "
                                              "are mixed (an interrupted save over this iteration?)",
                                              path=self.paths[pp_rank], field=key)
            self._files[pp_rank] = f
        return self._files[pp_rank]

    def check_same_save(self) -> None:
        """Raise unless every rank file comes from the same save (same ``save_id``).

        Files not opened yet are read for their header only: their pickle record is CRC-checked,
        their tensors are not read.
        """
        ids: dict[tuple[int, int], Any] = {}
        for key, path in self.all_paths.items():
            f = self._files.get(key[1]) if key[0] == 0 else self._tp_files.get(key)
            if f is None:
                if self.verify:
                    verify_file(path, pickle_only=True)
                f = read_state_file(path, verify=False)
            ids[key] = f.get("save_id")
        for key, path in self.ep_paths.items():
            f = self._ep_files.get(key)
            if key[2] == 0:
                continue                # the (tp, pp) file above
            if f is None:
                if self.verify:
                    verify_file(path, pickle_only=True)
                f = read_state_file(path, verify=False)
            ids[key] = f.get("save_id")
        mine = ids[(0, min(self._files))] if self._files else ids[min(ids)]
        for key, value in ids.items():
            if value != mine:
                raise CheckpointError(f"save_id {value!r} differs from {mine!r} of the other rank "
                                      "files: files of different saves are mixed (an interrupted "
                                      "save over this iteration?)",
                                      path=self.all_paths.get(key) or self.ep_paths.get(key),
                                      field="save_id")

    def schedule(self):
        """The schedule the checkpoint was written with: recorded as data (``schedule_data``),
        or, for checkpoints written before that, rebuilt from its name."""
        lay = self.layout
        if lay.get("schedule_data") is not None:
            return schedule_from_dict(lay["schedule_data"], source=f"checkpoint {self.dir}")
        return pipesim.build_schedule(lay["schedule"], pp=int(lay["pp"]), vpp=int(lay["vpp"]),
                                      microbatches=int(self.config["microbatches"]))

    def rank_layers(self, pp_rank: int) -> set[int]:
        """Global layers held by the checkpoint's pipeline rank ``pp_rank``.

        Computed from the recorded bounds and the schedule's placement (no need to open the
        file); the file's own record is checked when it is opened.
        """
        if self._placement is None:
            sched = self.schedule()
            bounds = self.layout["bounds"]
            # copies of a model part (dualpipe) are saved once, by the part's first stage
            self._placement = [{i for s in saved_stages(sched, r)
                                for i in stage_layer_range(sched, bounds, s)}
                               for r in range(self.pp)]
        return set(self._placement[pp_rank])

    def ranks_holding(self, layers: Iterable[int]) -> list[int]:
        """Pipeline ranks of the checkpoint whose chunks hold any of ``layers``."""
        wanted = set(layers)
        return [r for r in range(self.pp) if self.rank_layers(r) & wanted]

    def model_tensors(self, names: Iterable[str]) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
        """The model tensors ``names`` (global parameter / buffer names), wherever they are.

        Returns (name -> tensor, name -> file it came from). Raises naming the missing key, or a
        key held in the checkpoint for one of these layers that the caller did not ask for
        (unexpected: the model and the checkpoint disagree about the layer's contents).
        """
        names = list(names)
        layers = {layer_of(n) for n in names}
        found: dict[str, torch.Tensor] = {}
        origin: dict[str, Path] = {}
        for r in self.ranks_holding(layers):
            f, path = self.file(r), self.path(r)
            recorded = {i for chunk in f["layout"]["layers"] for i in chunk}
            if recorded != self.rank_layers(r):
                raise CheckpointError(f"file records layers {sorted(recorded)} but the checkpoint's "
                                      f"layout places layers {sorted(self.rank_layers(r))} on "
                                      f"pipeline rank {r}", path=path, field="layout.layers")
            for c, chunk in enumerate(model_chunks(f, str(path))):
                for key, value in chunk.items():
                    if layer_of(key) in layers:
                        found[key] = self.whole(
                            r, key, lambda g, c=c, key=key: model_chunks(g, None)[c][key])
                        origin[key] = path
        wanted = set(names)
        unexpected = sorted(set(found) - wanted)
        if unexpected:
            k = unexpected[0]
            raise CheckpointError(f"unexpected key {k!r} in the model state (the model has no such "
                                  f"parameter or buffer; {len(unexpected)} unexpected in all)",
                                  path=origin[k], field=k)
        missing = [n for n in names if n not in found]
        if missing:
            where = [str(self.path(r)) for r in self.ranks_holding(layers)] or [str(self.dir)]
            raise CheckpointError(f"missing key {missing[0]!r} in the model state "
                                  f"({len(missing)} missing in all; looked in {', '.join(where)})",
                                  path=where[0], field=missing[0])
        return found, origin

    def optimizer_state(self, names: Iterable[str]) -> tuple[dict[str, dict], set[str]]:
        """AdamW state of ``names`` (those that have one) and the set of names the checkpoint's
        optimizers knew (to tell "never stepped" from "missing")."""
        names = list(names)
        layers = {layer_of(n) for n in names}
        state: dict[str, dict] = {}
        known: set[str] = set()
        for r in self.ranks_holding(layers):
            f, path = self.file(r), self.path(r)
            opt = f.get("optimizer")
            if opt is None:
                raise CheckpointError("state file has no optimizer state", path=path, field="optimizer")
            known.update(opt["param_names"])
            for n in names:
                if n in opt["state"]:
                    state[n] = {k: (self.whole(r, n, lambda g, n=n, k=k: g["optimizer"]["state"][n][k])
                                    if torch.is_tensor(v) and v.dim() > 0 else v)
                                for k, v in opt["state"][n].items()}
        return state, known
