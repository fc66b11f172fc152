"""Checkpoints under expert parallelism: one file per (tp, pp, ep) rank in Megatron's
``mp_rank_TT_PPP_EEE``, each holding its own experts (``layout.experts``) and the dense
parameters; resume is bit-exact at ep 2, and a checkpoint reshards between ep 2 and ep 1 (the
experts put back together and cut again: the loaded weights and AdamW moments are exactly the
saved ones, and training goes on as from the saved state). ``checkpoint convert`` puts the
experts together (ep 1) and ``inspect`` lists every ep rank's file; under ZeRO-1 (experts
sharded over the expert-data-parallel group) resume is bit-exact too.

A tiny Mixtral (4 experts, top-2), dp 2 x pp 1 (2 forked gloo ranks), fp32.
"""
from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pipeexec import launch  # noqa: E402
from pipeexec.checkpoint.load import load_checkpoint  # noqa: E402
from pipeexec.checkpoint.save import save_checkpoint  # noqa: E402
from pipeexec.models.hf_expert_parallel import is_expert  # noqa: E402
from pipeexec.parallel.sharding import shard_spec  # noqa: E402
from pipeexec.topology import destroy_topology, init_topology  # noqa: E402
from pipeexec.training.train import train  # noqa: E402
from pipeexec.run.assemble import assemble  # noqa: E402

from test_expert_parallel import MIXTRAL, ep_config, whole_model  # noqa: E402
from test_hf_models import write_model  # noqa: E402

pytestmark = pytest.mark.slow


def worker(board, directory: str, ep: int, steps: int, load: str | None, save: str | None,
           zero: int = 0) -> dict:
    cfg = ep_config(directory, "1f1b", pp=1, dp=2, ep=ep, steps=steps, zero=zero)
    par = cfg.plan.parallelism
    topo = init_topology(par.pp, par.dp, ep=ep, device="cpu", timeout=120)
    try:
        trainer = assemble(cfg, topo, board=board)
        if load:
            load_checkpoint(trainer, load)
        named = {n: p for st in trainer.stages.values() for n, p in st.named_parameters()}
        out = {"specs": {n: shard_spec(p) for n, p in named.items()},
               "expert": {n: is_expert(p) for n, p in named.items()},
               "tp_rank": topo.tp_rank, "ep_rank": topo.ep_rank}
        out["loaded"] = {n: p.detach().clone() for n, p in trainer.named_parameters().items()}
        out["loaded_moments"] = {n: st["exp_avg"].clone()
                                 for n, st in trainer.full_state()[1].items()}
        res = train(trainer)
        if save:
            save_checkpoint(trainer, save)
        out["losses"] = res.losses
        out["params"] = {n: p.detach().clone() for n, p in trainer.named_parameters().items()}
        out["moments"] = {n: st["exp_avg"].clone() for n, st in trainer.full_state()[1].items()}
        return {"run": out}
    finally:
        destroy_topology(topo)


@functools.lru_cache(maxsize=None)
def run(directory: str, ep: int, steps: int, load: str | None = None,
        save: str | None = None, zero: int = 0) -> list[dict]:
    return launch(worker, 2, (directory, ep, steps, load, save, zero), timeout=300)


def whole(results: list[dict], what: str, ep: int) -> dict[str, torch.Tensor]:
    picked = [{"run": dict(r["run"], params=r["run"][what])} for r in results]
    return whole_model(picked, "run", 1, ep)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep_ckpt")
    directory = str(write_model(root / "mixtral", MIXTRAL))
    ep2, ep1 = str(root / "ep2"), str(root / "ep1")
    return {"dir": directory, "ep2": (ep2, run(directory, 2, 2, None, ep2)),
            "ep1": (ep1, run(directory, 1, 2, None, ep1))}


def test_one_file_per_expert_parallel_rank_with_its_experts(saved):
    root, _ = saved["ep2"]
    dirs = sorted(p.name for p in (Path(root) / "iter_0000002").iterdir())
    assert dirs == ["mp_rank_00_000_000", "mp_rank_00_000_001"]
    f = torch.load(Path(root) / "iter_0000002" / "mp_rank_00_000_001" / "model_optim_rng.pt",
                   weights_only=False)
    assert f["layout"]["ep"] == 2 and f["layout"]["ep_rank"] == 1
    experts = f["layout"]["experts"]
    assert "layers.1.block.mlp.experts.gate_up_proj" in experts
    assert "layers.1.block.mlp.gate.weight" not in experts
    assert f["model"]["layers.1.block.mlp.experts.gate_up_proj"].shape[0] == 2   # 4 / ep
    ep1_root, _ = saved["ep1"]
    assert sorted(p.name for p in (Path(ep1_root) / "iter_0000002").iterdir()) == ["mp_rank_00_000"]


def test_resume_at_ep_2_is_bit_exact(saved):
    root, _ = saved["ep2"]
    straight = run(saved["dir"], 2, 4)
    resumed = run(saved["dir"], 2, 4, root)
    assert resumed[0]["run"]["losses"] == straight[0]["run"]["losses"][2:]
    a, b = whole(straight, "params", 2), whole(resumed, "params", 2)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("src,dst", [("ep2", 1), ("ep1", 2)])
def test_reshard_between_ep_2_and_1(saved, src, dst):
    root, before = saved[src]
    src_ep = 2 if src == "ep2" else 1
    after = run(saved["dir"], dst, 4, root)
    want, got = whole(before, "params", src_ep), whole(after, "loaded", dst)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[n], got[n]) for n in want)
    want, got = whole(before, "moments", src_ep), whole(after, "loaded_moments", dst)
    assert want.keys() == got.keys() and any("experts" in n for n in want)
    assert all(torch.equal(want[n], got[n]) for n in want)
    # training goes on as the saved layout's would (ep sums an expert's gradient over its
    # tokens' ranks in another order: within rounding)
    straight = run(saved["dir"], src_ep, 4)
    torch.testing.assert_close(torch.tensor(after[0]["run"]["losses"]),
                               torch.tensor(straight[0]["run"]["losses"][2:]), rtol=1e-5, atol=0)
    a, b = whole(straight, "params", src_ep), whole(after, "params", dst)
    for n in a:
        torch.testing.assert_close(b[n], a[n], rtol=1e-5, atol=1e-6, msg=n)


def test_convert_and_inspect_understand_expert_shards(saved, tmp_path):
    from pipeexec.checkpoint.convert import convert_checkpoint
    from pipeexec.checkpoint.inspect import describe
    from pipeexec.checkpoint.reader import CheckpointReader
    root, before = saved["ep2"]
    text = describe(root)
    assert "mp_rank_00_000_000" in text and "mp_rank_00_000_001" in text and "ep=2" in text
    report = convert_checkpoint(root, tmp_path / "whole")
    assert any("expert-parallel shards of ep 2 put together" in n for n in report.notes)
    reader = CheckpointReader(tmp_path / "whole")
    assert reader.ep == 1
    want = whole(before, "params", 2)
    got, _ = reader.model_tensors(list(want))
    assert all(torch.equal(want[n], got[n]) for n in want)


def test_zero_1_at_ep_2_resumes_bit_exact_and_loads_at_ep_1(saved, tmp_path):
    """Under ZeRO-1 the experts' masters and moments are shards of the expert-data-parallel
    group, gathered whole by name for the file: resume is bit-exact, and the same file loads
    into an ep 1 run without ZeRO with exactly the saved weights and moments."""
    root = str(tmp_path / "zero1")
    before = run(saved["dir"], 2, 2, None, root, 1)
    straight = run(saved["dir"], 2, 4, None, None, 1)
    resumed = run(saved["dir"], 2, 4, root, None, 1)
    assert resumed[0]["run"]["losses"] == straight[0]["run"]["losses"][2:]
    a, b = whole(straight, "params", 2), whole(resumed, "params", 2)
    assert all(torch.equal(a[n], b[n]) for n in a)
    after = run(saved["dir"], 1, 4, root)
    for what in ("params", "moments"):
        want = whole(before, what, 2)
        got = whole(after, "loaded" if what == "params" else "loaded_moments", 1)
        assert want.keys() == got.keys()
        assert all(torch.equal(want[n], got[n]) for n in want), what
