"""Process topology: which pipeline rank and data-parallel replica this process is, and the
explicit process groups that connect it.

Global rank ``g = pp_rank * dp + dp_rank`` (data parallel innermost, as Megatron orders it), so
one pipeline is the ranks ``{p * dp + d}`` for a fixed ``d`` and one data-parallel group is the
ranks ``{p * dp + d}`` for a fixed ``p``. Groups are returned in a `Topology` value and passed to
whoever needs them; nothing is stored in module globals.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


class TopologyError(RuntimeError):
    """The environment does not describe a usable layout."""


def layout_rank(pp_rank: int, dp_rank: int, dp: int) -> int:
    return pp_rank * dp + dp_rank


@dataclass
class Topology:
    rank: int                 # global rank
    world_size: int
    pp: int
    dp: int
    pp_rank: int
    dp_rank: int
    local_rank: int
    device: torch.device
    backend: str
    pp_group: Any             # ProcessGroup of this pipeline (None when pp == 1)
    dp_group: Any             # ProcessGroup of this data-parallel group (None when dp == 1)
    pp_ranks: tuple[int, ...]  # global rank of each pipeline rank of this pipeline
    dp_ranks: tuple[int, ...]
    store: Any = None          # the c10d store (failure notes, checkpoint barriers)
    # Four process groups over this pipeline's ranks, one per p2p channel: (activation or
    # gradient) x (towards a higher or a lower pipeline rank); see p2p.channel().
    p2p_groups: tuple = ()

    def pipeline_peer(self, pp_rank: int) -> int:
        """Global rank of pipeline rank ``pp_rank`` in this replica's pipeline."""
        return self.pp_ranks[pp_rank]

    def __str__(self) -> str:
        return (f"rank {self.rank}/{self.world_size} (pp rank {self.pp_rank}/{self.pp}, "
                f"dp rank {self.dp_rank}/{self.dp}, {self.device}, {self.backend})")


def env_rank_info() -> tuple[int, int, int, str, int]:
    """(rank, world_size, local_rank, master_addr, master_port) from torchrun's variables."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise TopologyError(f"environment lacks {', '.join(missing)}: launch with torchrun or "
                            "`pipeexec train --nproc N`")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    return rank, world, local, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])


def pick_device(local_rank: int, device: str | None) -> torch.device:
    if device is not None:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", local_rank)
        return dev
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_topology(pp: int, dp: int, *, backend: str | None = None, device: str | None = None,
                  timeout: float = 600.0) -> Topology:
    """Initialise torch.distributed from the environment and build the pp and dp groups.

    ``world_size`` must equal ``pp * dp``: checked before any collective, with the reason.
    """
    rank, world, local_rank, addr, port = env_rank_info()
    if world != pp * dp:
        raise TopologyError(f"world size {world} != pp * dp = {pp} * {dp} = {pp * dp}")
    dev = pick_device(local_rank, device)
    if backend is None:
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        if backend == "nccl" and local_world > torch.cuda.device_count():
            raise TopologyError(f"{local_world} ranks on this node but {torch.cuda.device_count()} "
                                "CUDA device(s): NCCL needs one GPU per rank (use fewer ranks, or "
                                "--device cpu for gloo on CPU)")
        torch.cuda.set_device(dev)
    # torchrun's agent hosts a store at MASTER_PORT; the local launcher makes rank 0 host it.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    td = datetime.timedelta(seconds=timeout)
    store = dist.TCPStore(addr, port, world, is_master=(rank == 0 and not agent_store), timeout=td,
                          wait_for_workers=False)
    store = dist.PrefixStore("pipeexec", store)
    kwargs = {"device_id": dev} if dev.type == "cuda" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=td, **kwargs)
    pp_rank, dp_rank = divmod(rank, dp)
    pp_group = dp_group = None
    pp_ranks: tuple[int, ...] = ()
    dp_ranks: tuple[int, ...] = ()
    # Every rank creates every group, in the same order (a torch.distributed requirement).
    p2p_groups: tuple = ()
    for d in range(dp):
        ranks = tuple(layout_rank(p, d, dp) for p in range(pp))
        group = dist.new_group(list(ranks), timeout=td) if pp > 1 else None
        # NCCL matches sends and receives between two ranks in posting order, whatever the tag,
        # and a receive waiting on a communicator's stream holds up the sends queued behind it.
        # One communicator per (kind, direction) keeps each stream one-way and each one's order
        # the same on both sides (pipesim schedules keep that order per kind and direction).
        channels = (group, *(dist.new_group(list(ranks), timeout=td) for _ in range(3))) if pp > 1 else ()
        if d == dp_rank:
            pp_group, pp_ranks, p2p_groups = group, ranks, channels
    for p in range(pp):
        ranks = tuple(layout_rank(p, d, dp) for d in range(dp))
        group = dist.new_group(list(ranks), timeout=td) if dp > 1 else None
        if p == pp_rank:
            dp_group, dp_ranks = group, ranks
    return Topology(rank, world, pp, dp, pp_rank, dp_rank, local_rank, dev, backend,
                    pp_group, dp_group, pp_ranks, dp_ranks, store, p2p_groups)


def destroy_topology(topology: Topology) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
