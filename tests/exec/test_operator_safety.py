"""What an operator who breaks things on purpose must not get away with, in the executor:
checkpoint folders that lead a save (or its clean-up) outside the checkpoint through a
symbolic link."""
from __future__ import annotations

import shutil

import pytest
import torch

from pipeexec.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from pipeexec.config import TrainConfig
from pipeexec.topology import Topology, channel_keys
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
