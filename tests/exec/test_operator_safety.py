"""What an operator who breaks things on purpose must not get away with, in the executor: a
run's rendezvous store (and gloo transport) listening on every interface, checkpoint folders
that lead a save (or its clean-up) outside the checkpoint through a symbolic link."""
from __future__ import annotations

import datetime
import os
import shutil
import socket

import pytest
import torch

from pipeexec.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from pipeexec.config import TrainConfig
from pipeexec.launching.launcher import launch
from pipeexec.topology import Topology, channel_keys, open_store
from pipeexec.training.train import Trainer, train

TINY = TrainConfig(layers=2, hidden=16, heads=2, seq_len=8, vocab=32, steps=1, lr=3e-3,
                   microbatches=2, micro_batch_size=2, seed=3, device="cpu")


def alone(cfg: TrainConfig) -> Trainer:
    """A one-rank trainer without a process group (pp = dp = 1 steps alone)."""
    topo = Topology(0, 1, 1, 1, 0, 0, 0, torch.device("cpu"), "gloo", None, None, (0,), (0,),
                    None, p2p_groups={k: None for k in channel_keys(1)})
    return Trainer(cfg, topo)


@pytest.fixture(scope="module")
def stepped():
    t = alone(TINY)
    train(t)
    return t


def _outside(tmp_path):
    out = tmp_path / "elsewhere"
    out.mkdir()
    (out / "keep.txt").write_text("not the checkpoint's")
    return out


@pytest.mark.parametrize("link", ["iter_0000001", "iter_0000001/mp_rank_00_000"])
def test_save_refuses_a_symlinked_iteration_or_rank_folder(stepped, tmp_path, link):
    root, out = tmp_path / "ckpt", _outside(tmp_path)
    (root / link).parent.mkdir(parents=True, exist_ok=True)
    (root / link).symlink_to(out, target_is_directory=True)
    with pytest.raises(CheckpointError, match="symbolic link") as info:
        save_checkpoint(stepped, root)
    assert str(root / link) in str(info.value)
    assert sorted(p.name for p in out.rglob("*")) == ["keep.txt"]      # nothing written there
    assert not (root / "latest_checkpointed_iteration.txt").exists()


def test_load_refuses_a_symlinked_iteration_folder(stepped, tmp_path):
    root, out = tmp_path / "ckpt", tmp_path / "moved"
    save_checkpoint(stepped, root)
    shutil.move(root / "iter_0000001", out)
    (root / "iter_0000001").symlink_to(out, target_is_directory=True)
    with pytest.raises(CheckpointError, match="symbolic link") as info:
        load_checkpoint(alone(TINY), root)
    assert str(root / "iter_0000001") in str(info.value)


def test_load_refuses_a_symlinked_rank_folder(stepped, tmp_path):
    root, out = tmp_path / "ckpt", tmp_path / "moved"
    save_checkpoint(stepped, root)
    rank = root / "iter_0000001" / "mp_rank_00_000"
    shutil.move(rank, out)
    rank.symlink_to(out, target_is_directory=True)
    with pytest.raises(CheckpointError, match="symbolic link") as info:
        load_checkpoint(alone(TINY), root)
    assert str(rank) in str(info.value)


def test_pruning_never_follows_a_symlinked_old_iteration(tmp_path):
    t = alone(TINY.replace(steps=2))
    root, out = tmp_path / "ckpt", _outside(tmp_path)
    (out / "mp_rank_00_000").mkdir()
    root.mkdir()
    (root / "iter_0000000").symlink_to(out, target_is_directory=True)   # an "old" iteration
    train(t)
    with pytest.raises(CheckpointError, match="symbolic link"):
        save_checkpoint(t, root, keep_last=1)
    assert (out / "keep.txt").read_text() == "not the checkpoint's"
    assert (out / "mp_rank_00_000").is_dir()


# -- listening sockets -------------------------------------------------------------------------
WILDCARDS = ("0.0.0.0", "::")


def listening_sockets(pid: int | str = "self") -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process ``pid`` holds in the LISTEN state, read from
    /proc (the kernel's own table, as ``ss -ltnp`` reads it)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    out = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            lines = open(f"/proc/net/{table}").read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state != "0A" or inode not in inodes:          # 0A: TCP_LISTEN
                continue
            hexaddr, hexport = local.split(":")
            raw = bytes.fromhex(hexaddr)          # 32-bit words in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            out.append((socket.inet_ntop(family, raw), int(hexport, 16)))
    return out


def _listening_worker(board):
    import torch.distributed as dist
    from pipeexec.topology import destroy_topology, init_topology
    topo = init_topology(2, 1, timeout=60)
    try:
        dist.barrier()                     # every rank's store client and gloo pairs are up
        return {"port": int(os.environ["MASTER_PORT"]), "sockets": listening_sockets()}
    finally:
        dist.barrier()
        destroy_topology(topo)


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp")
def test_a_local_run_listens_on_loopback_only():
    results = launch(_listening_worker, 2, timeout=120)
    port = results[0]["port"]
    assert ("127.0.0.1", port) in results[0]["sockets"]       # rank 0 hosts the store
    for rank, r in enumerate(results):
        assert r["sockets"], f"rank {rank}: no listening socket seen (the check saw nothing)"
        wild = [s for s in r["sockets"] if s[0] in WILDCARDS]
        assert not wild, f"rank {rank} listens on every interface: {wild}"
        assert all(s[0].startswith("127.") or s[0] == "::1" for s in r["sockets"]), r["sockets"]


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp")
def test_the_store_binds_the_address_the_run_names():
    # a multi-node run names rank 0's address: the store listens there alone (127.0.0.2 is an
    # address of this host other than 127.0.0.1, as a second interface's would be)
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        port = s.getsockname()[1]
    store = open_store("127.0.0.2", port, 1, True, datetime.timedelta(seconds=30))
    store.set("k", "v")
    assert [a for a, p in listening_sockets() if p == port] == ["127.0.0.2"]
    del store


def test_an_address_not_of_this_host_is_refused_naming_it():
    from pipeexec.topology import TopologyError
    with pytest.raises(TopologyError, match="MASTER_ADDR='192.0.2.1'"):
        open_store("192.0.2.1", 29999, 1, True, datetime.timedelta(seconds=5))
