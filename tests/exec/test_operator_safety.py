"""What an operator who breaks things on purpose must not get away with, in the executor: a
run's rendezvous store (and gloo transport) listening on every interface, checkpoint folders
that lead a save (or its clean-up) outside the checkpoint through a symbolic link."""
from __future__ import annotations

import datetime
import math
import os
import shutil
import socket

import pytest
import torch

from pipeexec.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from pipeexec.config import TrainConfig
from pipeexec.launching.launcher import launch
from pipeexec.topology import Topology, channel_keys, open_store
from pipeexec.parallel.mesh import Mesh
from pipeexec.training.train import Trainer, train
from pipeexec.run.assemble import assemble

TINY = TrainConfig.from_flat(layers=2, hidden=16, heads=2, seq_len=8, vocab=32, steps=1, lr=3e-3,
                             microbatches=2, micro_batch_size=2, seed=3, device="cpu")


def alone(cfg: TrainConfig) -> Trainer:
    """A one-rank trainer without a process group (pp = dp = 1 steps alone)."""
    topo = Topology.of(Mesh(), 0, device=torch.device("cpu"), backend="gloo",
                       p2p_groups={k: None for k in channel_keys(1)})
    return assemble(cfg, topo)


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
    t = alone(TINY.with_flat(steps=2))
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


# -- resuming another model ----------------------------------------------------------------------
MIXTRAL = dict(model_type="mixtral", hidden_size=16, intermediate_size=24, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=1, vocab_size=32,
               max_position_embeddings=64, num_local_experts=4, num_experts_per_tok=2,
               rope_theta=1e6, hidden_act="silu", bos_token_id=1, eos_token_id=2)


def _hf_config(directory, **changes):
    import json
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**MIXTRAL, **changes}))
    return TrainConfig.from_flat(seq_len=8, steps=2, decay_steps=4, microbatches=2,
                                 micro_batch_size=2, seed=3,
                                 device="cpu").with_hf_model(str(directory))


@pytest.fixture(scope="module")
def mixtral_checkpoint(tmp_path_factory):
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("mixtral")
    cfg = _hf_config(root / "model").with_flat(steps=1)
    t = alone(cfg)
    train(t)
    save_checkpoint(t, root / "ckpt")
    return root


# (config.json change, the key the refusal names, the checkpoint's value, this run's)
CHANGES = [({"num_experts_per_tok": 1}, "model.hf_config.num_experts_per_tok", 2, 1),
           ({"rope_theta": 1e4}, "model.hf_config.rope_theta", 1e6, 1e4),
           ({"hidden_act": "gelu"}, "model.hf_config.hidden_act", "silu", "gelu")]


@pytest.mark.parametrize("change,key,saved,now", CHANGES, ids=[k for _, k, _, _ in CHANGES])
def test_resuming_a_changed_hf_model_is_refused_before_any_worker(mixtral_checkpoint, change,
                                                                   key, saved, now):
    from pipeexec.checkpoint import CheckpointOptions
    from pipeexec.run.preflight import check_train
    cfg = _hf_config(mixtral_checkpoint / "changed", **change)
    options = CheckpointOptions(load=str(mixtral_checkpoint / "ckpt"))
    with pytest.raises(CheckpointError) as info:
        check_train(cfg, options, nproc=1, cpus_per_rank=None)
    msg = str(info.value)
    assert f"{key}={saved!r}" in msg and f"{key}={now!r}" in msg, msg
    assert f"--allow-model-change {key}" in msg and "mp_rank_00_000" in msg
    # the override lets it through (the preflight, then the load itself)
    allowed = CheckpointOptions(load=options.load, allow_model_change=(key,))
    check_train(cfg, allowed, nproc=1, cpus_per_rank=None)


def test_the_load_itself_refuses_a_changed_model_and_takes_the_override(mixtral_checkpoint):
    cfg = _hf_config(mixtral_checkpoint / "topk1", num_experts_per_tok=1)
    ckpt = mixtral_checkpoint / "ckpt"
    with pytest.raises(CheckpointError, match="model.hf_config.num_experts_per_tok"):
        load_checkpoint(alone(cfg), ckpt)
    report = load_checkpoint(alone(cfg), ckpt, allow_model_change=("num_experts_per_tok",))
    assert report.iteration == 1
    assert any("num_experts_per_tok 2 -> 1" in n for n in report.notes)
    # finetuning (weights only) a changed top-k is allowed and noted
    tuned = load_checkpoint(alone(cfg), ckpt, finetune=True)
    assert tuned.iteration == 0 and any("num_experts_per_tok 2 -> 1" in n for n in tuned.notes)


def test_an_unchanged_model_resumes(mixtral_checkpoint):
    cfg = _hf_config(mixtral_checkpoint / "same")
    report = load_checkpoint(alone(cfg), mixtral_checkpoint / "ckpt")
    assert report.iteration == 1 and not any("model changed" in n for n in report.notes)


def test_allow_model_change_is_a_flag_of_train():
    from pipeexec.cli.checkpoint import options_from_args
    from pipeexec.cli.train import train_parser
    ns = train_parser().parse_args(["--load", "x", "--allow-model-change",
                                    "model.hf_config.rope_theta,top_k"])
    assert options_from_args(ns).allow_model_change == ("model.hf_config.rope_theta", "top_k")
    with pytest.raises(ValueError, match="--allow-model-change needs --load"):
        options_from_args(train_parser().parse_args(["--allow-model-change", "top_k"]))


# -- a run that no longer trains stops ----------------------------------------------------------
def test_a_diverged_fp32_run_stops_naming_the_step(tmp_path, capsys):
    """lr 1e30 makes step 0's update blow the weights up, so step 1's loss is NaN: the 2-rank
    run stops there with exit code 1 and one line naming step 1, its last checkpoint the one
    of step 0 (iteration 1), none written after it; the one-process reference stops alike."""
    from pipeexec.cli.train import train_main
    from pipeexec.training.divergence import TrainingDiverged
    ckpt = tmp_path / "ckpt"
    with pytest.raises(SystemExit) as info:
        train_main(["--pp", "2", "--microbatches", "2", "--lr", "1e30", "--steps", "4",
                    "--save", str(ckpt), "--save-interval", "1", "--no-progress"])
    assert info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "TrainingDiverged: step 1: the loss is nan" in err[0], err
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000001"]
    # the reference: the same model and batch in one process
    ref = alone(TrainConfig.from_flat(microbatches=2, lr=1e30, steps=4, device="cpu"))
    assert math.isfinite(ref.step().loss)
    with pytest.raises(TrainingDiverged, match="step 1: the loss is nan") as stopped:
        ref.step()
    assert stopped.value.step == 1 and ref.iteration == 1 and ref.updates == 1


def test_fp16_stops_after_too_many_skipped_steps():
    from pipeexec.training.divergence import TrainingDiverged
    cfg = TINY.with_flat(precision="fp16", steps=5, max_skipped_steps=2,
                         inject=("overflow:0", "overflow:1", "overflow:2", "overflow:3"))
    t = alone(cfg)
    assert [t.step().skipped for _ in range(2)] == [True, True]     # the scale backs off
    with pytest.raises(TrainingDiverged, match="step 2: 3 consecutive fp16 steps overflowed"):
        t.step()
    assert t.updates == 0
    # a finite step in between starts the count again
    t = alone(cfg.with_flat(inject=("overflow:0", "overflow:1", "overflow:3", "overflow:4")))
    assert [t.step().skipped for _ in range(5)] == [True, True, False, True, True]


def test_max_skipped_steps_is_checked():
    from pipeexec.config import ConfigError
    assert TrainConfig().mixed_precision.max_skipped_steps == 100
    with pytest.raises(ConfigError, match="max_skipped_steps must be an integer >= 1, got 0"):
        TrainConfig.from_flat(max_skipped_steps=0).validate()


def test_the_built_in_gpt_compares_its_resolved_shape():
    from pipeexec.checkpoint.contents import check_model, model_changes
    base = TrainConfig.from_flat(hidden=64, heads=4)
    same = TrainConfig.from_flat(hidden=64, heads=4, kv_heads=4,
                                 ffn_hidden=256)                  # the defaults, spelt
    assert model_changes(base.to_dict(), same.to_dict()) == []
    with pytest.raises(CheckpointError, match="heads=4, this run has heads=8"):
        check_model(base.to_dict(), TrainConfig.from_flat(hidden=64, heads=8).to_dict())
