"""Process topology: where this process sits in the plan's device mesh (tensor, context, data
and pipeline parallel), and the explicit process groups that connect it.

Ranks follow `pipeexec.parallel.mesh.Mesh`, Megatron-LM's order (tensor parallel fastest, then
context, data, pipeline: ``g = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank``). One
pipeline is the ranks of one (tp, cp, dp) position; its p2p channels carry that rank's
activation (its cp rank's chunks of the sequence, whole on every tp rank or cut again under
sequence parallelism), never a gathered one. The dense parameters' gradients are averaged over
the dp x cp group (Megatron's ``dp_cp``: with cp each of its ranks saw other tokens of the same
sequences). Expert parallelism (``ep``) is carved out of dp x cp (`Mesh`'s expert layout): the
all-to-alls of a MoE layer run over the ep group on communicators of their own, and the expert
parameters' gradients are averaged over the expert-data-parallel group. Groups are returned in a `Topology` value and passed to whoever needs them; nothing
is stored in module globals.
"""
from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .launching.devices import check_unique_gpus, gpu_uuid, pick_device
from .parallel.mesh import Mesh


class TopologyError(RuntimeError):
    """The environment does not describe a usable layout."""


@dataclass(frozen=True)
class DimGroup:
    """One parallel dimension as this rank sees it: its ``size``, this rank's place in it
    (``rank``), the global ``ranks`` of its group in that order and the process ``group`` (None
    when of size 1, or in a topology built without process groups)."""

    size: int
    rank: int
    ranks: tuple[int, ...]
    group: Any = None


# The groups of a rank, in the order every rank creates them: pipeline, data, tensor, context,
# the dense gradients' data x context (Megatron's dp_cp), expert, expert-data-parallel.
DIMS = ("pp", "dp", "tp", "cp", "dp_cp", "ep", "edp")
# A gradient group that is another group while the dimension it adds has size 1: dp_cp is dp's
# without context parallelism, edp (the experts' gradients) dp_cp's without expert parallelism.
_SAME_AS = {"dp_cp": ("dp", "cp"), "edp": ("dp_cp", "ep")}


def mesh_groups(mesh: Mesh, dim: str) -> list[tuple[int, ...]]:
    """Every group of dimension ``dim`` (one of `DIMS`), in creation order."""
    if dim == "dp_cp":
        return mesh.groups(("dp", "cp"))
    if dim == "ep":
        return mesh.ep_groups()
    if dim == "edp":
        return mesh.edp_groups()
    return mesh.groups(dim)


class _View:
    """A `Topology` attribute read off one dimension: ``tp_group`` is ``dims["tp"].group``."""

    def __init__(self, dim: str, field: str) -> None:
        self.dim, self.field = dim, field

    def __get__(self, topology: Any, owner: type) -> Any:
        if topology is None:
            return self
        return getattr(topology.dims[self.dim], self.field)


def _views(dim: str) -> tuple[_View, _View, _View, _View]:
    """The size, this rank's place, the group and its ranks of ``dim``, read flat."""
    return _View(dim, "size"), _View(dim, "rank"), _View(dim, "group"), _View(dim, "ranks")


@dataclass
class Topology:
    """This rank (``rank`` of ``world_size``, ``local_rank`` on its host, its ``device`` and
    ``backend``) and its group of every parallel dimension (``dims``: `DimGroup` by name in
    `DIMS`), read flat as well: ``tp``, ``tp_rank``, ``tp_group``, ``tp_ranks`` and so on.
    ``store``: the c10d store (failure notes, checkpoint barriers); ``p2p_groups``: the 2-rank
    process group of every p2p channel this rank is an end of, keyed (FWD or BWD, src pipeline
    rank, dst pipeline rank); see `channel_keys`."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    dims: dict[str, DimGroup]
    store: Any = None
    p2p_groups: dict = field(default_factory=dict)

    pp, pp_rank, pp_group, pp_ranks = _views("pp")
    dp, dp_rank, dp_group, dp_ranks = _views("dp")
    tp, tp_rank, tp_group, tp_ranks = _views("tp")
    cp, cp_rank, cp_group, cp_ranks = _views("cp")
    dp_cp, dp_cp_rank, dp_cp_group, dp_cp_ranks = _views("dp_cp")
    ep, ep_rank, ep_group, ep_ranks = _views("ep")
    edp, edp_rank, edp_group, edp_ranks = _views("edp")

    @classmethod
    def of(cls, mesh: Mesh, rank: int, *, device: torch.device, backend: str,
           local_rank: int = 0, store: Any = None, groups: dict[str, Any] | None = None,
           p2p_groups: dict | None = None) -> "Topology":
        """Rank ``rank`` of ``mesh``: every dimension's members from the mesh, its process
        group from ``groups`` (by dimension; none given: a rank that can be built, loaded and
        saved without process groups, and stepped alone)."""
        dims = {}
        for dim in DIMS:
            ranks = next(g for g in mesh_groups(mesh, dim) if rank in g)
            dims[dim] = DimGroup(len(ranks), ranks.index(rank), ranks, (groups or {}).get(dim))
        return cls(rank, mesh.world_size, local_rank, device, backend, dims, store,
                   dict(p2p_groups or {}))

    @property
    def mesh(self) -> Mesh:
        return Mesh(tp=self.tp, cp=self.cp, dp=self.dp, pp=self.pp, ep=self.ep)

    def rank_of(self, *, pp_rank: int | None = None, dp_rank: int | None = None,
                tp_rank: int | None = None, cp_rank: int | None = None) -> int:
        """The global rank at these coordinates (this rank's where one is not given)."""
        return self.mesh.rank(pp=self.pp_rank if pp_rank is None else pp_rank,
                              dp=self.dp_rank if dp_rank is None else dp_rank,
                              tp=self.tp_rank if tp_rank is None else tp_rank,
                              cp=self.cp_rank if cp_rank is None else cp_rank)

    def pipeline_peer(self, pp_rank: int) -> int:
        """Global rank of pipeline rank ``pp_rank`` in this replica's pipeline."""
        return self.pp_ranks[pp_rank]

    def __str__(self) -> str:
        tp = f"tp rank {self.tp_rank}/{self.tp}, " if self.tp > 1 else ""
        tp += f"cp rank {self.cp_rank}/{self.cp}, " if self.cp > 1 else ""
        tp += f"ep rank {self.ep_rank}/{self.ep}, " if self.ep > 1 else ""
        return (f"rank {self.rank}/{self.world_size} ({tp}pp rank {self.pp_rank}/{self.pp}, "
                f"dp rank {self.dp_rank}/{self.dp}, {self.device}, {self.backend})")


def channel_keys(pp: int) -> list[tuple[int, int, int]]:
    """Every p2p channel of a pipeline of ``pp`` ranks, in the order all ranks create them:
    (kind 0 activation / 1 gradient, src, dst) for each ordered pair of ring neighbours (the
    pairs every builder's placement uses: looped ``stage % pp`` and V-shape)."""
    pairs = sorted({(r, (r + 1) % pp) for r in range(pp)} | {((r + 1) % pp, r) for r in range(pp)})
    return [(kind, a, b) for a, b in pairs if a != b for kind in (0, 1)]


def nccl_diagnostics_defaults() -> None:
    """Turn on torch's NCCL flight recorder unless the user chose otherwise: on a timeout the
    watchdog then dumps the last collectives and p2p operations of every rank (read them with
    ``python -m torch.distributed.flight_recorder.fr_trace``; README, GPUs)."""
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")


def env_rank_info() -> tuple[int, int, int, str, int]:
    """(rank, world_size, local_rank, master_addr, master_port) from torchrun's variables."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise TopologyError(f"environment lacks {', '.join(missing)}: launch with torchrun or "
                            "`pipeexec train --nproc N`")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    return rank, world, local, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])


def listen_socket(addr: str, port: int) -> socket.socket:
    """A TCP socket listening on ``addr`` (MASTER_ADDR) alone, port ``port``.

    torch's TCPStore server binds every interface (``*:PORT``) whatever host it is given, and
    answers anyone who connects, unauthenticated: any machine that reaches this one could read
    and write the run's keys. Bound here to the address the run names instead (127.0.0.1 for a
    local run, so only this machine reaches it; rank 0's address in a multi-node run), and
    handed to the store as its listening socket."""
    try:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise TopologyError(f"MASTER_ADDR={addr!r} does not resolve ({exc}): give an address of "
                            "rank 0's host") from None
    errors = []
    for family, kind, proto, _, sockaddr in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
            sock.listen(max(128, socket.SOMAXCONN))
            return sock
        except OSError as exc:
            sock.close()
            errors.append(f"{sockaddr[0]}: {exc.strerror or exc}")
    raise TopologyError(f"rank 0 cannot listen on MASTER_ADDR={addr!r} port {port} "
                        f"({'; '.join(errors) or 'no address'}): MASTER_ADDR must be an address "
                        "of rank 0's host, and MASTER_PORT free")


def open_store(addr: str, port: int, world: int, is_master: bool,
               timeout: datetime.timedelta) -> Any:
    """The run's TCPStore; hosted (``is_master``) on a socket bound to MASTER_ADDR alone
    (`listen_socket`), never on every interface."""
    if not is_master:
        return dist.TCPStore(addr, port, world, is_master=False, timeout=timeout,
                             wait_for_workers=False)
    for use_libuv in (True, False):      # a torch whose libuv server takes no socket: the other
        fd = listen_socket(addr, port).detach()      # the store owns it from here
        try:
            return dist.TCPStore(addr, port, world, is_master=True, timeout=timeout,
                                 wait_for_workers=False, master_listen_fd=fd,
                                 use_libuv=use_libuv)
        except (RuntimeError, ValueError):
            try:
                os.close(fd)
            except OSError:
                pass
            if not use_libuv:
                raise
    raise AssertionError("unreachable")


def init_topology(pp: int, dp: int, *, tp: int = 1, cp: int = 1, ep: int = 1,
                  backend: str | None = None,
                  device: str | None = None, timeout: float = 600.0,
                  p2p_timeout: float | None = None) -> Topology:
    """Initialise torch.distributed from the environment and build the groups of every
    dimension of `DIMS` (pipeline with its p2p channels, data, tensor, context, data x context,
    expert, expert-data-parallel), each only where it has more than one rank.

    ``p2p_timeout``: on NCCL, the p2p channel groups' timeout is this plus a minute, so that the
    watchdog aborts a stuck transfer even when the host is stuck too (the runtime's own check at
    the end of each step names the action first; `pipeexec.pipeline.p2p`).

    ``world_size`` must equal ``tp * cp * pp * dp``: checked before any collective, with the
    reason, and ``ep`` must divide ``dp * cp``.
    """
    rank, world, local_rank, addr, port = env_rank_info()
    try:
        mesh = Mesh(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep)
    except ValueError as exc:
        raise TopologyError(str(exc)) from None
    if world != mesh.world_size:
        raise TopologyError(f"world size {world} != tp * cp * pp * dp = {tp} * {cp} * {pp} * "
                            f"{dp} = {mesh.world_size}")
    dev = pick_device(local_rank, device)
    if backend is None:
        backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    # torchrun's agent hosts a store at MASTER_PORT; the local launcher makes rank 0 host it.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    td = datetime.timedelta(seconds=timeout)
    store = open_store(addr, port, world, rank == 0 and not agent_store, td)
    store = dist.PrefixStore("pipeexec", store)
    if dev.type == "cuda" and backend == "nccl":
        check_unique_gpus(store, rank, world, gpu_uuid(dev), timeout)
        nccl_diagnostics_defaults()
    kwargs = {"device_id": dev} if dev.type == "cuda" else {}
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=td, **kwargs)
    # Every rank creates every group, in the same order (a torch.distributed requirement).
    # Tensor-parallel collectives, context parallelism's K/V exchange and expert parallelism's
    # all-to-alls run inside computations: each dimension gets communicators (hence NCCL
    # streams) of its own, apart from the p2p channels and from the gradient groups.
    # P2P channels: one 2-rank group per (kind, src, dst), so that on NCCL each communicator,
    # hence each stream, carries one kind one way between two ranks (pipesim.schedule.channels:
    # no deadlock for any builder; a group over the whole pipeline would put "receive from i-1"
    # and "send to i+1" on one stream, which deadlocks some schedules).
    groups: dict[str, Any] = {}
    p2p_groups: dict = {}
    order: list = []                # every channel, in creation order (the warm-up's)
    channel_td = td if p2p_timeout is None else datetime.timedelta(seconds=p2p_timeout + 60)
    for dim in DIMS:
        same_as, added = _SAME_AS.get(dim, (None, None))
        if same_as is not None and getattr(mesh, added) == 1:
            groups[dim] = groups[same_as]
            continue
        for ranks in mesh_groups(mesh, dim):
            group = dist.new_group(list(ranks), timeout=td) if len(ranks) > 1 else None
            if rank in ranks:
                groups[dim] = group
            for key in channel_keys(len(ranks)) if dim == "pp" else ():
                members = [ranks[key[1]], ranks[key[2]]]
                channel = dist.new_group(sorted(members), timeout=channel_td)
                order.append((key, members, channel))
                if rank in members:
                    p2p_groups[key] = channel
        if dim == "pp":
            warm_up_channels(order, rank, dev, timeout)
    return Topology.of(mesh, rank, device=dev, backend=backend, local_rank=local_rank,
                       store=store, groups=groups, p2p_groups=p2p_groups)


def warm_up_channels(order: list, rank: int, device: torch.device, timeout: float) -> None:
    """One tiny transfer over every channel this rank is an end of, all ranks walking the
    channels in the same global order, each waiting for its transfer before the next.

    torch 2.6-2.7 create a NCCL communicator lazily at a group's first p2p operation, and that
    creation blocks until both ranks arrive; during a step, two ranks arriving at two channels
    in opposite orders would deadlock. Here the lowest-numbered unfinished channel always has
    both its ranks at it (each has finished every lower one), so warm-up completes, and after
    it no communicator is created during a step. With ``device_id`` (torch >= 2.8) `new_group`
    creates each 2-rank communicator eagerly, a rendezvous of its two ranks; every rank creates
    the groups in the same global order, so the same argument applies there."""
    td = datetime.timedelta(seconds=timeout)
    for key, (src, dst), group in order:
        if rank not in (src, dst):
            continue
        buf = torch.zeros(1, device=device)
        work = dist.isend(buf, dst, group=group) if rank == src else dist.irecv(buf, src, group=group)
        try:
            work.wait(td)
        except Exception as exc:
            raise TopologyError(f"rank {rank}: warming up p2p channel {key} (rank {src} -> "
                                f"{dst}) failed: {exc}") from exc


def destroy_topology(topology: Topology) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
