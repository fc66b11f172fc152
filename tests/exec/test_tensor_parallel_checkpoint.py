"""Checkpoints under tensor parallelism: one file per (tp rank, pp rank), Megatron's
``mp_rank_TT_PPP``, each shard with its `ShardSpec`; resume is bit-exact at the same tp, and a
checkpoint reshards between tp 2 and tp 1 (weights and AdamW moments put back together and
cut again: the loaded model is exactly the saved one, and training goes on as from the saved
state, within the bounds of tensor parallelism's other summation order).
"""
from __future__ import annotations

import functools

import pytest
import torch

from pipeexec import launch
from pipeexec.checkpoint.load import load_checkpoint
from pipeexec.checkpoint.save import save_checkpoint
from pipeexec.parallel.sharding import shard_spec, unshard
from pipeexec.topology import destroy_topology, init_topology
from pipeexec.training.train import train
from pipeexec.run.assemble import assemble

from exec_helpers import layout_config

pytestmark = pytest.mark.slow


def worker(board, tp: int, steps: int, load: str | None, save: str | None) -> dict:
    cfg = layout_config("1f1b", 2, 1, tp=tp, sequence_parallel=tp > 1, steps=steps)
    par = cfg.plan.parallelism
    topo = init_topology(par.pp, par.dp, tp=tp, device="cpu", timeout=120)
    try:
        trainer = assemble(cfg, topo, board=board)
        if load:
            load_checkpoint(trainer, load)
        loaded = {n: p.detach().clone() for n, p in trainer.named_parameters().items()}
        loaded_moments = {n: st["exp_avg"].clone() for n, st in trainer.full_state()[1].items()}
        res = train(trainer)
        if save:
            save_checkpoint(trainer, save)
        specs = {n: shard_spec(p) for st in trainer.stages.values()
                 for n, p in st.named_parameters()}
        moments = {n: st["exp_avg"].clone() for n, st in trainer.full_state()[1].items()}
        return {"losses": res.losses, "loaded": loaded, "loaded_moments": loaded_moments,
                "specs": specs, "tp_rank": topo.tp_rank,
                "params": {n: p.detach().clone() for n, p in trainer.named_parameters().items()},
                "moments": moments}
    finally:
        destroy_topology(topo)


@functools.lru_cache(maxsize=None)
def run(tp: int, steps: int, load: str | None = None, save: str | None = None) -> list[dict]:
    return launch(worker, 2 * tp, (tp, steps, load, save), timeout=300)


def whole(results: list[dict], key: str) -> dict[str, torch.Tensor]:
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    specs = {}
    for r in results:
        for n, t in r[key].items():
            if t is not None:
                pieces.setdefault(n, {})[r["tp_rank"]] = t
                specs[n] = r["specs"][n]
    return {n: (unshard([p[t] for t in sorted(p)], specs[n]) if specs[n] is not None else p[0])
            for n, p in pieces.items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_ckpt")
    tp2 = str(root / "tp2")
    tp1 = str(root / "tp1")
    return {"tp2": (tp2, run(2, 2, None, tp2)), "tp1": (tp1, run(1, 2, None, tp1))}


def test_files_per_tensor_parallel_rank_with_their_shards(saved):
    from pathlib import Path
    root, _ = saved["tp2"]
    dirs = sorted(p.name for p in (Path(root) / "iter_0000002").iterdir())
    assert dirs == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    f = torch.load(Path(root) / "iter_0000002" / "mp_rank_01_000" / "model_optim_rng.pt",
                   weights_only=False)
    assert f["layout"]["tp"] == 2 and f["layout"]["tp_rank"] == 1
    assert f["layout"]["shards"]["layers.1.qkv.weight"] == {"dim": 0, "groups": 3}
    assert "layers.1.ln1.weight" not in f["layout"]["shards"]


def test_resume_at_the_same_tp_is_bit_exact(saved):
    root, _ = saved["tp2"]
    straight = run(2, 4)
    resumed = run(2, 4, root)
    assert resumed[0]["losses"] == straight[0]["losses"][2:]
    a, b = whole(straight, "params"), whole(resumed, "params")
    assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("src,dst", [("tp2", 1), ("tp1", 2)])
def test_reshard_between_tp_2_and_1(saved, src, dst):
    root, before = saved[src]
    after = run(dst, 4, root)
    # what was loaded is exactly what was saved: weights and AdamW moments
    want, got = whole(before, "params"), whole(after, "loaded")
    assert want.keys() == got.keys()
    assert all(torch.equal(want[n], got[n]) for n in want)
    want, got = whole(before, "moments"), whole(after, "loaded_moments")
    assert want.keys() == got.keys() and len(want) > 10
    assert all(torch.equal(want[n], got[n]) for n in want)
    # training goes on as the saved layout's would
    straight = run(2 if src == "tp2" else 1, 4)
    torch.testing.assert_close(torch.tensor(after[0]["losses"]),
                               torch.tensor(straight[0]["losses"][2:]), rtol=1e-5, atol=0)
    a, b = whole(straight, "params"), whole(after, "params")
    for n in a:
        torch.testing.assert_close(b[n], a[n], rtol=1e-5, atol=1e-6, msg=n)


def test_convert_puts_the_shards_together(saved, tmp_path):
    from pipeexec.checkpoint.convert import convert_checkpoint
    from pipeexec.checkpoint.reader import CheckpointReader
    root, before = saved["tp2"]
    report = convert_checkpoint(root, tmp_path / "whole", pp=1)
    assert any("shards of tp 2 put together" in n for n in report.notes)
    reader = CheckpointReader(tmp_path / "whole")
    assert reader.tp == 1 and reader.pp == 1
    want = whole(before, "params")
    got, _ = reader.model_tensors(list(want))
    assert all(torch.equal(want[n], got[n]) for n in want)
