"""Checkpointing in one process: layout, contents, exact resume, the load modes, atomicity
under injected faults, retention, every error path, resharded loads and conversion, inspect.

Multi-process behaviour (real gloo ranks, dp gathering, kill mid-save) is in
test_checkpoint_dist.py. Trainers here run on a hand-made topology without a process group:
pp = dp = 1 trains; a rank of a larger layout can be built alone to load into.
"""
from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist

from checkpoint_helpers import TINY, flip_bit, local_trainer, params_of
from pipeexec.checkpoint import (RELEASE, CheckpointError, CheckpointReader, convert_checkpoint,
                                 describe, load_checkpoint, read_tracker, save_checkpoint,
                                 state_file, tracker_path)
from pipeexec.checkpoint.atomic import atomic_write
from pipeexec.cli.checkpoint import main as checkpoint_main
from pipeexec.checkpoint.rng import capture_rng_state, restore_rng_state
from pipeexec.training.train import train


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A pp=1 run saved at iterations 2 (dir ``two``) and the same run continued to 4."""
    root = tmp_path_factory.mktemp("ckpt")
    t = local_trainer(TINY.with_flat(steps=2))
    first = train(t).losses
    save_checkpoint(t, root / "two")
    at2 = params_of(t)
    opt2 = {n: {k: v.clone() for k, v in t.optimizer.state[p].items()}
            for n, p in t.named_parameters().items()}
    rng_after_save = torch.rand(5)
    t.config = TINY   # continue the same run to 4
    rest = train(t).losses
    return {"root": root, "dir": root / "two", "losses": first + rest, "at2": at2, "opt2": opt2,
            "at4": params_of(t), "rng_after_save": rng_after_save}


def test_layout_is_megatrons(tmp_path):
    assert state_file(tmp_path, 50, 3) == tmp_path / "iter_0000050" / "mp_rank_00_003" / "model_optim_rng.pt"
    assert state_file(tmp_path, RELEASE, 0) == tmp_path / "release" / "mp_rank_00_000" / "model_optim_rng.pt"
    assert tracker_path(tmp_path).name == "latest_checkpointed_iteration.txt"


def test_file_holds_the_complete_state(trained):
    d = trained["dir"]
    assert tracker_path(d).read_text() == "2\n"
    f = torch.load(state_file(d, 2, 0), weights_only=True)
    assert f["checkpoint_version"] == 1 and f["iteration"] == 2 and f["release"] is False
    assert (f["config"]["hidden"] == TINY.plan.model.hidden
            and f["consumed_samples"] == 2 * TINY.global_batch)
    assert f["layout"]["layers"] == [list(range(TINY.num_layers))]
    assert set(f["model"]) == set(trained["at2"])
    for n, v in trained["at2"].items():
        assert torch.equal(f["model"][n], v), n
        for k, s in trained["opt2"][n].items():
            assert torch.equal(f["optimizer"]["state"][n][k], s), (n, k)
    assert f["opt_param_scheduler"]["num_updates"] == 2
    assert f["loss_scaler"]["scale"] == 1.0
    assert len(f["rng_state"]) == 1 and set(f["rng_state"][0]) == {"python", "numpy", "torch", "cuda"}


def test_resume_is_bitwise_exact(trained):
    t = local_trainer(TINY)
    report = load_checkpoint(t, trained["dir"])
    assert (t.iteration, t.updates, report.resharded) == (2, 2, False)
    assert torch.equal(torch.rand(5), trained["rng_after_save"])   # torch RNG restored
    losses = train(t).losses
    assert losses == trained["losses"][2:]          # bitwise: == on Python floats
    after = params_of(t)
    assert all(torch.equal(after[n], v) for n, v in trained["at4"].items())


def test_rng_roundtrip():
    state = capture_rng_state("cpu")
    want = (random.random(), np.random.rand(3).tolist(), torch.rand(3))
    random.random(), np.random.rand(7), torch.rand(9)
    restore_rng_state(state, "cpu")
    got = (random.random(), np.random.rand(3).tolist(), torch.rand(3))
    assert got[:2] == want[:2] and torch.equal(got[2], want[2])


def test_load_modes(trained, tmp_path):
    fine = local_trainer(TINY)
    load_checkpoint(fine, trained["dir"], finetune=True)
    assert (fine.iteration, fine.updates, len(fine.optimizer.state)) == (0, 0, 0)
    assert all(torch.equal(fine.named_parameters()[n], v) for n, v in trained["at2"].items())

    no_optim = local_trainer(TINY)
    report = load_checkpoint(no_optim, trained["dir"], load_optim=False)
    assert (no_optim.iteration, no_optim.updates, len(no_optim.optimizer.state)) == (2, 2, 0)
    assert "optimizer" not in report.loaded and "rng" in report.loaded

    keep = local_trainer(TINY)        # (building a model draws from the global RNG)
    torch.manual_seed(1234)
    expected = torch.rand(3)
    torch.manual_seed(1234)
    load_checkpoint(keep, trained["dir"], load_rng=False)
    assert torch.equal(torch.rand(3), expected)     # RNG left alone

    # release: weights only, tracker "release", loads as iteration 0
    src = local_trainer(TINY)
    load_checkpoint(src, trained["dir"])
    save_checkpoint(src, tmp_path, release=True)
    assert read_tracker(tmp_path) == RELEASE
    f = torch.load(state_file(tmp_path, RELEASE, 0), weights_only=True)
    assert f["release"] and "optimizer" not in f and "rng_state" not in f
    dst = local_trainer(TINY)
    report = load_checkpoint(dst, tmp_path)
    assert (dst.iteration, report.loaded) == (0, ["model"])
    assert all(torch.equal(dst.named_parameters()[n], v) for n, v in trained["at2"].items())


@pytest.mark.parametrize("phase", ["before-rename", "before-tracker"])
def test_failed_save_leaves_the_previous_checkpoint(trained, tmp_path, phase):
    t = local_trainer(TINY)
    load_checkpoint(t, trained["dir"])
    save_checkpoint(t, tmp_path)
    train(t)                                            # to iteration 4
    with pytest.raises(CheckpointError, match="injected"):
        save_checkpoint(t, tmp_path, fault=f"raise:0:4:{phase}")
    assert read_tracker(tmp_path) == 2
    assert state_file(tmp_path, 4, 0).exists() == (phase == "before-tracker")
    assert not [p for p in state_file(tmp_path, 4, 0).parent.glob(".*")]   # temp file cleaned
    back = local_trainer(TINY)
    assert load_checkpoint(back, tmp_path).iteration == 2
    assert all(torch.equal(back.named_parameters()[n], v) for n, v in trained["at2"].items())


def test_atomic_write_keeps_the_old_file_when_interrupted(tmp_path):
    path = tmp_path / "f.bin"
    atomic_write(path, lambda f: f.write(b"old"))

    def boom(tmp):
        assert tmp.read_bytes() == b"new, complete"
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, lambda f: f.write(b"new, complete"), before_rename=boom)
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def test_keep_last(trained, tmp_path):
    t = local_trainer(TINY)
    (tmp_path / "iter_0000009").mkdir()                 # an abandoned later run: left alone
    for it in range(1, 5):
        t.config = TINY.with_flat(steps=it)
        train(t)
        report = save_checkpoint(t, tmp_path, keep_last=2)
    assert report.removed == [2]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("iter")) == \
        ["iter_0000003", "iter_0000004", "iter_0000009"]
    assert read_tracker(tmp_path) == 4


def _copy_checkpoint(src, dst):
    import shutil
    shutil.copytree(src, dst)
    return dst


def _rewrite(path, change):
    f = torch.load(path, weights_only=True)
    change(f)
    torch.save(f, path)


@pytest.mark.parametrize("case", ["no dir", "no tracker", "garbage tracker", "binary tracker",
                                  "tracker to missing dir", "truncated", "bit flip", "config",
                                  "missing key", "unexpected key", "shape", "missing rank file",
                                  "missing optimizer key", "version"])
def test_errors_name_the_file_and_field(trained, tmp_path, case):
    d = _copy_checkpoint(trained["dir"], tmp_path / "c")
    f = state_file(d, 2, 0)
    field = None
    expect_path = str(f)
    if case == "no dir":
        d = tmp_path / "nowhere"
        expect_path = str(d)
    elif case == "no tracker":
        tracker_path(d).unlink()
        expect_path = str(tracker_path(d))
    elif case in ("garbage tracker", "binary tracker"):
        tracker_path(d).write_bytes(b"latest\n" if case == "garbage tracker" else b"\xff\xfe\x00")
        expect_path = str(tracker_path(d))
    elif case == "tracker to missing dir":
        tracker_path(d).write_text("7")
        expect_path = str(d / "iter_0000007")
    elif case == "truncated":
        data = f.read_bytes()
        f.write_bytes(data[: len(data) // 2])
    elif case == "bit flip":
        field = flip_bit(f, bit=0x10)
    elif case == "config":
        field = "hidden"
    elif case == "missing key":
        _rewrite(f, lambda s: s["model"].pop("layers.3.fc1.weight"))
        field = "layers.3.fc1.weight"
    elif case == "unexpected key":
        _rewrite(f, lambda s: s["model"].__setitem__("layers.3.extra", torch.zeros(2)))
        field = "layers.3.extra"
    elif case == "shape":
        _rewrite(f, lambda s: s["model"].__setitem__("layers.2.proj.bias", torch.zeros(3)))
        field = "layers.2.proj.bias"
    elif case == "missing rank file":
        _rewrite(f, lambda s: s["layout"].__setitem__("pp", 2))
        expect_path = str(state_file(d, 2, 1))
    elif case == "missing optimizer key":
        _rewrite(f, lambda s: s["optimizer"]["param_names"].remove("layers.1.ln1.weight"))
        field = "optimizer.layers.1.ln1.weight"
    elif case == "version":
        _rewrite(f, lambda s: s.__setitem__("checkpoint_version", 99))
        field = "checkpoint_version"
    cfg = TINY.with_flat(hidden=32, heads=2) if case == "config" else TINY
    t = local_trainer(cfg)
    before = params_of(t)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(t, d)
    assert err.value.path == expect_path, str(err.value)
    assert expect_path in str(err.value)
    if field is not None:
        assert err.value.field == field and field.removeprefix("optimizer.") in str(err.value)
    after = params_of(t)                                # nothing was loaded
    assert t.iteration == 0 and all(torch.equal(after[n], v) for n, v in before.items())


def test_a_file_read_for_its_header_only_has_its_pickle_checked(trained, tmp_path):
    """Rank 0 of a pp=2 load reads rank 1's file for the save's id only: a flipped bit in that
    file's pickle record is a CRC failure naming the file and record, never an unpickling error
    or a silently changed value (both happened before: which one depends on where the bit
    lands, since the pickle holds the save's random id)."""
    cfg = TINY.with_flat(pp=2, schedule="1f1b")
    convert_checkpoint(trained["dir"], tmp_path, pp=2, vpp=1, schedule="1f1b",
                       microbatches=cfg.plan.microbatches)
    other = state_file(tmp_path, 2, 1)
    record = flip_bit(other, "data.pkl")
    t = local_trainer(cfg, pp_rank=0)
    before = params_of(t)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(t, tmp_path)
    assert err.value.path == str(other) and str(other) in str(err.value)
    assert err.value.field == record and "CRC-32" in str(err.value)
    after = params_of(t)
    assert t.iteration == 0 and all(torch.equal(after[n], v) for n, v in before.items())


def _expected_layers(cfg, pp_rank):
    import pipesim
    from pipeexec.partition import make_partition
    from pipeexec.models import layer_stack
    if cfg.layout.partition == "layers" and cfg.layout.boundaries is None:
        # pipesim's cut of the plan's blocks, the embedding first and the head last
        blocks = cfg.plan.stage_layers()
        sizes = [n + (s == 0) + (s == len(blocks) - 1) for s, n in enumerate(blocks)]
        bounds = tuple(sum(sizes[:s]) for s in range(len(sizes) + 1))
    else:
        bounds = make_partition(cfg.num_layers, cfg.num_stages, cfg.layout.partition,
                                cfg.layout.boundaries, layer_stack(cfg).layer_param_counts())
    par = cfg.plan.parallelism
    sched = pipesim.build_schedule(cfg.plan.schedule_name, pp=par.pp, vpp=par.vpp,
                                   microbatches=cfg.plan.microbatches)
    return {i for s in sched.rank_stages(pp_rank) for i in range(bounds[s], bounds[s + 1])}


RESHARD = [dict(pp=2, schedule="1f1b"), dict(pp=2, vpp=2, schedule="interleaved"),
           dict(pp=4, schedule="gpipe", microbatches=4, micro_batch_size=2),
           dict(pp=2, vpp=2, schedule="zbv"), dict(pp=3, partition="params")]


@pytest.mark.parametrize("changes", RESHARD, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_resharded_load_and_convert(trained, tmp_path, changes):
    """Every rank of another layout gets exactly its layers' weights and AdamW state, whether it
    loads the pp=1 checkpoint directly or a converted copy (which then loads as is)."""
    cfg = TINY.with_flat(**changes)
    par = cfg.plan.parallelism
    convert_checkpoint(trained["dir"], tmp_path, pp=par.pp, vpp=par.vpp,
                       schedule=cfg.plan.schedule_name, microbatches=cfg.plan.microbatches,
                       partition=cfg.layout.partition)
    assert read_tracker(tmp_path) == 2
    for source, resharded in ((trained["dir"], True), (tmp_path, False)):
        seen = set()
        for r in range(cfg.plan.parallelism.pp):
            t = local_trainer(cfg, pp_rank=r)
            report = load_checkpoint(t, source)
            assert report.resharded == resharded and t.iteration == 2
            got = t.named_parameters()
            assert {int(n.split(".")[1]) for n in got} == _expected_layers(cfg, r)
            for n, p in got.items():
                assert torch.equal(p, trained["at2"][n]), n
                for k, v in trained["opt2"][n].items():
                    assert torch.equal(t.optimizer.state[p][k], v), (n, k)
            seen |= set(got)
        assert seen == set(trained["at2"])
    # the converted files are the new layout's own
    for r in range(cfg.plan.parallelism.pp):
        f = torch.load(state_file(tmp_path, 2, r), weights_only=True)
        held = {i for chunk in f["layout"]["layers"] for i in chunk}
        assert held == _expected_layers(cfg, r) and f["config"]["pp"] == cfg.plan.parallelism.pp


def _threaded_save(cfg, trainers, root, **kwargs):
    """Save from every rank of a layout at once (threads share a HashStore for the barrier)."""
    errors = []

    def run(t):
        try:
            save_checkpoint(t, root, timeout=30, **kwargs)
        except BaseException as e:   # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(t,)) for t in trainers]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    if errors:
        raise errors[0]


def test_multi_rank_checkpoint_back_to_one_rank(trained, tmp_path):
    """pp=4 vpp=2 (written by four ranks) loads into pp=1: the same weights by name."""
    cfg = TINY.with_flat(pp=4, vpp=2, schedule="interleaved", microbatches=4, micro_batch_size=2)
    store = dist.HashStore()
    ranks = [local_trainer(cfg, pp_rank=r, store=store) for r in range(4)]
    for t in ranks:
        load_checkpoint(t, trained["dir"])
    _threaded_save(cfg, ranks, tmp_path)
    f1 = torch.load(state_file(tmp_path, 2, 1), weights_only=True)
    assert {"model0", "model1"} <= set(f1) and "model" not in f1      # Megatron's chunk keys
    same = local_trainer(cfg, pp_rank=2)
    report = load_checkpoint(same, tmp_path)            # same layout: reads its own file only
    assert not report.resharded and report.files == [str(state_file(tmp_path, 2, 2))]
    one = local_trainer(TINY)
    report = load_checkpoint(one, tmp_path)
    assert report.resharded and len(report.files) == 4
    assert all(torch.equal(p, trained["at2"][n]) for n, p in one.named_parameters().items())
    assert train(one).losses == trained["losses"][2:]                  # still bitwise here


def test_barrier_names_the_missing_rank(trained, tmp_path):
    cfg = TINY.with_flat(pp=2)
    t = local_trainer(cfg, pp_rank=0, store=dist.HashStore())
    load_checkpoint(t, trained["dir"])
    with pytest.raises(CheckpointError, match=r"waiting for ranks \[1\]"):
        save_checkpoint(t, tmp_path, timeout=0.3)
    assert not tracker_path(tmp_path).exists()


def test_inspect(trained, tmp_path, capsys):
    text = describe(trained["dir"])
    n = len(trained["at2"])
    for piece in ("tracker latest_checkpointed_iteration.txt: 2", "iteration 2",
                  "consumed_samples 16", "hidden=16", "pp=1", "mp_rank_00_000/model_optim_rng.pt",
                  f"AdamW state for {n} of {n} parameters", "num_updates 2"):
        assert piece in text, piece
    assert checkpoint_main(["checkpoint", "inspect", str(trained["dir"])]) == 0
    assert "iteration 2" in capsys.readouterr().out
    assert checkpoint_main(["checkpoint", "inspect", str(tmp_path)]) == 1
    assert "no tracker file" in capsys.readouterr().err
    reader = CheckpointReader(trained["dir"])
    assert reader.iteration == 2 and reader.pp == 1


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_resume_is_exact(tmp_path, precision):
    """fp32 masters, the 16-bit weights, the loss scale and the LR position (updates, which lag
    the iteration after a skipped fp16 step) all come back: the continued run is bitwise the same."""
    cfg = TINY.with_flat(precision=precision, inject=("overflow:1",) if precision == "fp16" else ())
    full = local_trainer(cfg)
    losses = train(full).losses
    first = local_trainer(cfg.with_flat(steps=2))
    train(first)
    save_checkpoint(first, tmp_path)
    if precision == "fp16":
        # step 1 skipped
        assert (first.updates, first.scaler.scale) == (1, cfg.mixed_precision.loss_scale / 2)
    resumed = local_trainer(cfg)
    load_checkpoint(resumed, tmp_path)
    assert (resumed.updates, resumed.scaler.scale) == (first.updates, first.scaler.scale)
    assert train(resumed).losses == losses[2:]
    assert all(torch.equal(a, b) for a, b in zip(full.masters.masters, resumed.masters.masters))
    assert all(a.dtype != torch.float32 and torch.equal(a, b)
               for a, b in zip(full.masters.model_params, resumed.masters.model_params))


def test_manager_follows_the_flags(trained, tmp_path):
    """--save-interval saves at multiples and once more at the end; --keep-last prunes; a run
    loaded at its last iteration does not re-save; --release ends with a weights-only save."""
    from pipeexec.checkpoint import CheckpointManager, CheckpointOptions

    t = local_trainer(TINY.with_flat(steps=5))
    m = CheckpointManager(CheckpointOptions(save=str(tmp_path), save_interval=2, keep_last=2,
                                            fault=None))
    train(t, on_step=m.on_step)
    m.finish(t)
    assert [r.tag for r in m.saves] == [2, 4, 5]
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000004", "iter_0000005"]
    assert len(m.metrics()["save_times"]) == 3 and all(s > 0 for s in m.metrics()["save_times"])

    again = CheckpointManager(CheckpointOptions(save=str(tmp_path), load=str(tmp_path), fault=None))
    t2 = local_trainer(TINY.with_flat(steps=5))
    assert again.load(t2).iteration == 5
    train(t2, on_step=again.on_step)
    again.finish(t2)
    assert again.saves == [] and again.metrics()["loaded_iteration"] == 5
    older = CheckpointManager(CheckpointOptions(load=str(tmp_path), ckpt_step=4, fault=None))
    assert older.load(local_trainer(TINY)).iteration == 4

    rel = CheckpointManager(CheckpointOptions(save=str(tmp_path), load=str(tmp_path), release=True,
                                              fault=None))
    rel.load(t2)
    rel.finish(t2)
    assert read_tracker(tmp_path) == RELEASE and [r.tag for r in rel.saves] == [RELEASE]


@pytest.mark.parametrize("kwargs, flag", [
    (dict(save_interval=2), "--save-interval"), (dict(save="d", keep_last=0), "--keep-last"),
    (dict(release=True), "--release"), (dict(finetune=True), "--finetune"),
    (dict(no_load_optim=True), "--no-load-optim"), (dict(no_load_rng=True), "--no-load-rng"),
    (dict(ckpt_step=3), "--ckpt-step"),
    (dict(fault="kill:x:2:before-rename"), "checkpoint fault")])
def test_options_reject_inconsistent_flags(kwargs, flag):
    from pipeexec.checkpoint import CheckpointOptions

    with pytest.raises(ValueError, match=flag):
        CheckpointOptions(**kwargs).validate()


def test_files_of_different_saves_are_not_mixed(trained, tmp_path):
    """Two saves of the same iteration (say an abandoned run and its replacement) have
    different save ids: a checkpoint holding files of both is refused, naming the odd file.
    A later save with fewer pipeline ranks removes the earlier save's extra rank directories."""
    import shutil

    cfg = TINY.with_flat(pp=4, vpp=2, schedule="interleaved", microbatches=4, micro_batch_size=2)
    store = dist.HashStore()
    ranks = [local_trainer(cfg, pp_rank=r, store=store) for r in range(4)]
    for t in ranks:
        load_checkpoint(t, trained["dir"])
    _threaded_save(cfg, ranks, tmp_path / "a")
    _threaded_save(cfg, ranks, tmp_path / "b", sequence=1)
    shutil.copy(state_file(tmp_path / "b", 2, 3), state_file(tmp_path / "a", 2, 3))
    with pytest.raises(CheckpointError, match="different saves are mixed") as err:
        load_checkpoint(local_trainer(cfg, pp_rank=0), tmp_path / "a")   # reads only file 0
    assert err.value.path == str(state_file(tmp_path / "a", 2, 3)) and err.value.field == "save_id"

    two = TINY.with_flat(pp=2)
    pair = [local_trainer(two, pp_rank=r, store=store) for r in range(2)]
    for t in pair:
        load_checkpoint(t, trained["dir"])
    _threaded_save(two, pair, tmp_path / "a", sequence=2)
    assert sorted(p.name for p in (tmp_path / "a" / "iter_0000002").iterdir()) == \
        ["mp_rank_00_000", "mp_rank_00_001"]
    back = local_trainer(TINY)
    load_checkpoint(back, tmp_path / "a")
    assert all(torch.equal(p, trained["at2"][n]) for n, p in back.named_parameters().items())


def test_convert_command(trained, tmp_path, capsys):
    dst = tmp_path / "pp2"
    assert checkpoint_main(["checkpoint", "convert", str(trained["dir"]), str(dst), "--pp", "2",
                            "--vpp", "2", "--schedule", "interleaved", "--boundaries", "1,3,6"]) == 0
    assert "converted iter_0000002 from pp=1" in capsys.readouterr().out
    f = torch.load(state_file(dst, 2, 1), weights_only=True)
    # explicit boundaries 0|1,2|3,4,5|6,7: pp rank 1 holds stages 1 and 3 (looped placement)
    assert f["layout"]["bounds"] == [0, 1, 3, 6, 8] and f["layout"]["layers"] == [[1, 2], [6, 7]]
    assert checkpoint_main(["checkpoint", "convert", str(trained["dir"]), str(dst), "--pp", "2"]) == 1
    assert "destination already holds a checkpoint" in capsys.readouterr().err
    assert checkpoint_main(["checkpoint", "convert", str(trained["dir"]), str(tmp_path / "x"),
                            "--pp", "16"]) == 1
    assert "stages" in capsys.readouterr().err                   # 8 layers cannot fill 16 stages
