"""Loading a checkpoint into a running rank, from the same layout or any other.

Every rank reads what it needs itself: the model and optimizer entries of its own parameters,
by global name, from whichever rank files hold those layers (its own file when the layout is
unchanged; several when pp, vpp or the partition changed). Nothing is loaded until everything
was checked: the config's model fields, every expected key present, no unexpected key, every
shape, optimizer state for every parameter. A problem is a `CheckpointError` naming the file
and the field, never a partial load or a silent random init.

Modes: a full resume (model, optimizer, LR position, loss scale, RNG, iteration); ``finetune``
(weights only, iteration 0); ``load_optim=False`` (fresh AdamW moments and loss scale, iteration
and LR position kept); ``load_rng=False``. A release checkpoint holds weights only and always
loads as ``finetune``.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .contents import check_config, chunk_stages, saved_stages, stage_layer_range
from .errors import CheckpointError
from .layout import Tag, tag_dir_name
from .reader import CheckpointReader
from .rng import restore_rng_state


@dataclass
class LoadReport:
    tag: Tag
    iteration: int                 # the trainer's iteration after the load
    seconds: float
    resharded: bool                # the checkpoint's layout differs from this run's
    files: list[str] = field(default_factory=list)      # rank files this rank read
    loaded: list[str] = field(default_factory=list)     # parts restored: model, optimizer, ...
    notes: list[str] = field(default_factory=list)      # config differences and the like


def expected_model_names(trainer) -> list[str]:
    """Names of this rank's model state: every parameter and persistent buffer of its stages."""
    names = []
    for s in chunk_stages(trainer):
        names.extend(trainer.stages[s].state_dict().keys())
    return names


class TensorParallelCut:
    """A whole tensor of the checkpoint cut to this rank's piece: by its parameter's
    `ShardSpec` when the run is tensor parallel, then, for an expert tensor under expert
    parallelism, to this ep rank's experts (dim 0); as it is otherwise."""

    def __init__(self, trainer) -> None:
        from ..models.hf_expert_parallel import is_expert
        from ..parallel.sharding import shard_spec
        topo = trainer.topology
        self.tp, self.rank = topo.tp, topo.tp_rank
        self.ep, self.ep_rank = getattr(topo, "ep", 1), getattr(topo, "ep_rank", 0)
        named = [(n, p) for s in chunk_stages(trainer)
                 for n, p in trainer.stages[s].named_parameters()]
        self.specs = {n: shard_spec(p) for n, p in named}
        self.experts = {n for n, p in named if is_expert(p)}

    def __call__(self, name: str, tensor: torch.Tensor, path: Any) -> torch.Tensor:
        from ..parallel.sharding import shard
        spec = self.specs.get(name)
        if spec is not None and self.tp > 1:
            try:
                tensor = shard(tensor, spec, self.rank, self.tp)
            except ValueError as exc:
                raise CheckpointError(f"{name!r}: {exc}", path=path, field=name) from None
        if name in self.experts and self.ep > 1:
            n = tensor.shape[0]
            if n % self.ep:
                raise CheckpointError(f"{name!r}: {n} experts do not divide over ep = {self.ep}",
                                      path=path, field=name)
            k = n // self.ep
            tensor = tensor[self.ep_rank * k: (self.ep_rank + 1) * k]
        return tensor


def same_layout(reader: CheckpointReader, trainer) -> bool:
    lay = reader.layout
    par = trainer.config.plan.parallelism
    return (int(lay.get("tp", 1)) == par.tp and int(lay.get("ep", 1)) == par.ep
            and int(lay["pp"]) == par.pp
            and int(lay["vpp"]) == par.vpp
            and [int(b) for b in lay["bounds"]] == [int(b) for b in trainer.bounds]
            and reader.rank_layers(trainer.topology.pp_rank) ==
            {i for s in saved_stages(trainer.schedule, trainer.topology.pp_rank)
             for i in stage_layer_range(trainer.schedule, trainer.bounds, s)})


@torch.no_grad()
def load_checkpoint(trainer, root: str | os.PathLike, *, tag: Tag | None = None,
                    finetune: bool = False, load_optim: bool = True, load_rng: bool = True,
                    verify: bool = True, log: Callable[[str], None] | None = None,
                    allow_model_change: tuple[str, ...] = ()) -> LoadReport:
    """Load checkpoint ``tag`` (default: the tracker's) from ``root`` into ``trainer``.
    ``allow_model_change``: keys of the model description that may differ from the
    checkpoint's on a resume (`contents.check_model`; ``--allow-model-change``)."""
    t0 = time.perf_counter()
    topo, cfg = trainer.topology, trainer.config
    reader = CheckpointReader(root, tag, verify=verify, home=topo.pp_rank)
    home = topo.pp_rank if topo.pp_rank < reader.pp else 0
    weights_only = finetune or reader.release
    notes = check_config(reader.config, cfg.to_dict(), path=str(reader.path(home)),
                         allow_model_change=allow_model_change, resume=not weights_only)
    resharded = not same_layout(reader, trainer)

    # -- model: every expected key, nothing else, right shapes --------------------------------
    names = expected_model_names(trainer)
    tensors, origin = reader.model_tensors(names)      # whole, whatever the checkpoint's tp
    cut = TensorParallelCut(trainer)
    tensors = {n: cut(n, t, origin[n]) for n, t in tensors.items()}
    masters = trainer.param_shapes()        # (whole shapes: no collective under ZeRO)
    local = {}
    for s in chunk_stages(trainer):
        local.update(trainer.stages[s].state_dict())
    for n in names:
        want = masters[n] if n in masters else tuple(local[n].shape)
        if tuple(tensors[n].shape) != want:
            raise CheckpointError(f"shape mismatch for {n!r}: {tuple(tensors[n].shape)} in the "
                                  f"checkpoint, {want} in the model", path=origin[n], field=n)
    state: dict = {"model": {n: tensors[n] for n in masters}, "optimizer": {}, "scaler": None,
                   "iteration": 0, "updates": 0}
    loaded = ["model"]

    # -- optimizer, LR position, loss scale --------------------------------------------------
    home_file = None if weights_only else reader.file(home)
    if home_file is not None:
        state["iteration"] = int(home_file["iteration"])
        state["updates"] = int(home_file["opt_param_scheduler"]["num_updates"])
        loaded.append("iteration")
    if home_file is not None and load_optim:
        opt, known = reader.optimizer_state(trainer.param_names)
        opt = {n: {k: (cut(n, v, origin[n]) if torch.is_tensor(v) and v.dim() > 0 else v)
                   for k, v in st.items()} for n, st in opt.items()}
        for n in trainer.param_names:
            if n not in known:
                raise CheckpointError(f"missing key {n!r} in the optimizer state",
                                      path=origin[n], field=f"optimizer.{n}")
            if state["updates"] > 0 and n not in opt:
                raise CheckpointError(f"no AdamW state for {n!r} after {state['updates']} updates",
                                      path=origin[n], field=f"optimizer.state.{n}")
            for k, v in opt.get(n, {}).items():
                if torch.is_tensor(v) and v.dim() > 0 and tuple(v.shape) != masters[n]:
                    raise CheckpointError(f"optimizer state {k!r} of {n!r} has shape "
                                          f"{tuple(v.shape)}, the parameter {masters[n]}",
                                          path=origin[n], field=f"optimizer.state.{n}.{k}")
        state["optimizer"] = opt
        state["scaler"] = home_file["loss_scaler"]
        loaded += ["optimizer", "opt_param_scheduler", "loss_scaler"]
    elif home_file is not None:
        loaded.append("opt_param_scheduler")
    saved_batch = (int(reader.config["dp"]) * int(reader.config["microbatches"])
                   * int(reader.config["micro_batch_size"]))
    if home_file is not None and saved_batch != cfg.global_batch:
        notes.append(f"global batch {saved_batch} -> {cfg.global_batch}: the data stream "
                     "continues by iteration, with a different number of samples per step")

    reader.check_same_save()

    # -- apply (nothing above changed the trainer) --------------------------------------------
    trainer.load_state_dict(state, load_optim=state["scaler"] is not None)
    buffers = [n for n in names if n not in masters]
    for s in chunk_stages(trainer):
        sd = trainer.stages[s].state_dict()
        for n in buffers:
            if n in sd:
                sd[n].copy_(tensors[n])

    if home_file is not None and load_rng:
        # a tensor-parallel rank's own file when the checkpoint has this tp
        own = reader.tp == topo.tp and topo.tp_rank < reader.tp
        rng_states = (reader.shard_file(home, topo.tp_rank) if own else home_file)["rng_state"]
        idx = topo.dp_rank if topo.dp_rank < len(rng_states) else 0
        restore_rng_state(rng_states[idx], topo.device, path=str(reader.path(home)))
        loaded.append("rng")
        if resharded or len(rng_states) != topo.dp:
            notes.append(f"RNG state taken from pp rank {home}, dp rank {idx} of the saved layout")

    report = LoadReport(reader.tag, int(trainer.iteration), time.perf_counter() - t0, resharded,
                        reader.opened(), loaded, notes)
    if topo.rank == 0 and log is not None:
        how = "finetune (weights only)" if weights_only else "resume"
        log(f"checkpoint: loaded {tag_dir_name(reader.tag)} from {Path(root)} in "
            f"{report.seconds:.3f} s as {how}, iteration {report.iteration}"
            + (f", resharded from tp={reader.tp} pp={reader.layout['pp']} vpp={reader.layout['vpp']} "
               f"dp={reader.layout['dp']} {reader.layout['schedule']}" if resharded else "")
            + f"; loaded {', '.join(loaded)}" + (f"; notes: {'; '.join(notes)}" if notes else ""))
    return report
