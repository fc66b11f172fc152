"""Expert parallelism (--ep) equals the unsplit Hugging Face Mixtral trained in one process.

A tiny Mixtral (hidden 32, 4 experts top-2, 2 decoder layers; fp32) whose experts are cut over
ep ranks of dp x cp (`pipeexec.parallel.experts`: tokens dispatched to their experts' owners by
all-to-all, dropless, and combined back). The reference is test_hf_models' (the unsplit
``MixtralForCausalLM`` with the layers' weights, the run's whole batch, AdamW,
clip_grad_norm_). Each rank's parameters are put back together: an expert tensor's local
experts (dim 0) concatenated in ep-rank order after any tp `ShardSpec`; dense parameters must
be bitwise equal on every ep rank, expert ones on every rank of the expert-data-parallel group.
Bounds as test_hf_tensor_parallel (losses rtol 1e-5, parameters rtol 1e-5 / atol 1e-6, AdamW
eps 1e-5).

Cases: ep 2 x pp 2 (dp 2) under 1F1B and ZB-V; ep 2 with dp 2 (expert dp 1, pp 1); dp 4 x ep 2
(expert dp 2), also under ZeRO 1-3 (experts sharded over the expert-data-parallel group);
ep 2 x pp 2 ZB-V under ZeRO-1; cp 2 x ep 2 x pp 2; tp 2 x ep 2 x pp 2 with sequence
parallelism (8 ranks). Errors: ep not dividing
dp x cp, experts not divisible by ep, a dense model.
"""
from __future__ import annotations

import functools

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pipeexec import launch  # noqa: E402
from pipeexec.config import ConfigError  # noqa: E402
from pipeexec.models.hf import hf_dir_stack, hf_name  # noqa: E402
from pipeexec.models.hf_config import read_hf_config  # noqa: E402
from pipeexec.models.hf_expert_parallel import is_expert  # noqa: E402
from pipeexec.parallel.sharding import shard_spec, unshard  # noqa: E402
from pipeexec.topology import destroy_topology, init_topology  # noqa: E402
from pipeexec.training.train import train  # noqa: E402
from pipeexec.run.assemble import assemble  # noqa: E402

from exec_helpers import TINY, layout_config  # noqa: E402
from test_hf_models import FAMILIES, hf_reference_train, reference_config, write_model  # noqa: E402

ADAM_EPS = 1e-5
MIXTRAL = dict(FAMILIES["mixtral"], num_hidden_layers=2)
SEQ = 16


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory) -> str:
    return str(write_model(tmp_path_factory.mktemp("hf-ep") / "mixtral", MIXTRAL))


def ep_config(directory: str, schedule: str, *, pp: int, dp: int, **changes):
    base = TINY.with_flat(seq_len=SEQ).with_hf_model(directory)
    return layout_config(schedule, pp, dp, base=base, eps=ADAM_EPS,
                         **changes)


def ep_worker(board, tp: int, pp: int, dp: int, ep: int, cases: list[tuple[str, dict]],
              cp: int = 1) -> dict:
    topo = init_topology(pp, dp, tp=tp, cp=cp, ep=ep, device="cpu", timeout=120)
    out = {}
    try:
        for schedule, changes in cases:
            changes = dict(changes)
            directory = changes.pop("hf_model")
            label = changes.pop("label", None)
            cfg = ep_config(directory, schedule, pp=pp, dp=dp, tp=tp, cp=cp, ep=ep, **changes)
            if label is not None:
                changes["label"] = label
            trainer = assemble(cfg, topo, board=board)
            res = train(trainer)
            named = {n: p for st in trainer.stages.values() for n, p in st.named_parameters()}
            out[(schedule, tuple(sorted(changes.items())))] = {
                "losses": res.losses, "config": cfg, "grad_norms": res.grad_norms,
                "params": {n: p.detach().clone() for n, p in trainer.named_parameters().items()},
                "specs": {n: shard_spec(p) for n, p in named.items()},
                "expert": {n: is_expert(p) for n, p in named.items()},
                "tp_rank": topo.tp_rank, "ep_rank": topo.ep_rank, "edp_rank": topo.edp_rank,
                "dp_rank": topo.dp_rank}
    finally:
        destroy_topology(topo)
    return out


def whole_model(results: list[dict], key, tp: int, ep: int) -> dict[str, torch.Tensor]:
    """The full parameters from every (tp, ep) rank's shard; replicas checked bitwise equal:
    dense ones over every rank holding them, expert ones over the expert-data-parallel group."""
    pieces: dict[str, dict[tuple[int, int], torch.Tensor]] = {}
    for r in results:
        entry = r[key]
        for n, p in entry["params"].items():
            where = (entry["tp_rank"], entry["ep_rank"] if entry["expert"][n] else 0)
            have = pieces.setdefault(n, {})
            if where in have:
                assert torch.equal(have[where], p), f"{n}: replicas differ at (tp, ep) {where}"
            else:
                have[where] = p
    specs = {n: s for r in results for n, s in r[key]["specs"].items()}
    experts = {n: e for r in results for n, e in r[key]["expert"].items()}
    full = {}
    for n, by in pieces.items():
        spec = specs[n]
        e_ranks = range(ep) if experts[n] else range(1)
        per_ep = []
        for e in e_ranks:
            if spec is None:
                for t in range(1, tp):
                    assert torch.equal(by[(t, e)], by[(0, e)]), f"replicated {n} differs on tp"
                per_ep.append(by[(0, e)])
            else:
                per_ep.append(unshard([by[(t, e)] for t in range(tp)], spec))
        full[n] = torch.cat(per_ep) if experts[n] else per_ep[0]
    return full


def check(runs: list[dict], key, tp: int, ep: int, label: str) -> None:
    cfg = runs[0][key]["config"]
    info = read_hf_config(cfg.inputs.hf_model)
    ref_losses, ref_params = _reference(reference_config(cfg).with_flat(
        tp=1, ep=1, sequence_parallel=False, recompute="none"))
    losses = [r[key]["losses"] for r in runs]
    assert all(ls == losses[0] for ls in losses), f"{label}: ranks disagree on the losses"
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(ref_losses), rtol=1e-5,
                               atol=0, msg=lambda m: f"{label}: losses: {m}")
    assert any(e for r in runs for e in r[key]["expert"].values()), label
    spec = hf_dir_stack(cfg.inputs.hf_model)
    seen = set()
    for n, p in whole_model(runs, key, tp, ep).items():
        hf = hf_name(info.model_type, info.layers, spec.canonical(n))
        seen.add(hf)
        torch.testing.assert_close(p, ref_params[hf], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=n, hf=hf: f"{label}: {n} ({hf}): {m}")
    assert seen == set(ref_params), label


@functools.lru_cache(maxsize=None)
def _reference(cfg):
    return hf_reference_train(cfg)


@functools.lru_cache(maxsize=None)
def _launch(tp: int, pp: int, dp: int, ep: int, cases: tuple, cp: int = 1) -> list[dict]:
    return launch(ep_worker, tp * cp * pp * dp,
                  (tp, pp, dp, ep, [(s, dict(ch)) for s, ch in cases], cp), timeout=900)


def _run(mixtral_dir, tp, pp, dp, ep, cases, cp=1):
    frozen = tuple((s, tuple(sorted(dict(ch, hf_model=mixtral_dir).items()))) for s, ch in cases)
    runs = _launch(tp, pp, dp, ep, frozen, cp)
    return runs, [(s, tuple(sorted(ch.items()))) for s, ch in cases]


def test_ep2_dp2_equals_the_unsplit_model(mixtral_dir):
    """pp 1, dp 2, ep 2: expert-data-parallel size 1 (each expert on one rank)."""
    runs, keys = _run(mixtral_dir, 1, 1, 2, 2, [("1f1b", {})])
    for key in keys:
        check(runs, key, 1, 2, f"ep2 dp2 {key}")


@pytest.mark.slow
def test_ep2_pp2_1f1b_and_zbv_equal_the_unsplit_model(mixtral_dir):
    """(ZB-V also under --nccl-matching: NCCL's matching emulated on gloo, the channel order
    checked with ep's collectives before the start.)"""
    runs, keys = _run(mixtral_dir, 1, 2, 2, 2, [("1f1b", {}), ("zbv", {}),
                                                 ("zbv", {"nccl_matching": True})])
    for key in keys:
        check(runs, key, 1, 2, f"ep2 pp2 dp2 {key}")


@pytest.mark.slow
def test_dp4_ep2_expert_data_parallel_equals_the_unsplit_model(mixtral_dir):
    """dp 4 x ep 2: each expert on two ranks, its gradient averaged over them."""
    runs, keys = _run(mixtral_dir, 1, 1, 4, 2, [("1f1b", {"microbatches": 2})])
    for key in keys:
        check(runs, key, 1, 2, f"dp4 ep2 {key}")


@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_shards_experts_over_the_expert_data_parallel_group(mixtral_dir, zero):
    """dp 4 x ep 2 under ZeRO 1-3: the dense parameters sharded over dp 4, the experts over
    their expert-data-parallel group of 2; ep 2 x pp 2 ZB-V under ZeRO-1 (a rank holding
    stages without experts has no expert holder; its peers in the group neither)."""
    runs, keys = _run(mixtral_dir, 1, 1, 4, 2, [("1f1b", {"microbatches": 2, "zero": zero})])
    for key in keys:
        check(runs, key, 1, 2, f"dp4 ep2 zero {zero} {key}")
    if zero == 1:
        runs, keys = _run(mixtral_dir, 1, 2, 2, 2, [("zbv", {"zero": 1})])
        for key in keys:
            check(runs, key, 1, 2, f"ep2 pp2 zbv zero 1 {key}")


@pytest.mark.slow
def test_cp2_ep2_pp2_equals_the_unsplit_model(mixtral_dir):
    """cp 2 x ep 2 x pp 2 (dp 1): the ep group is the cp group; each rank's tokens are its
    sequence chunks, its experts' gradients averaged by dp x cp."""
    runs, keys = _run(mixtral_dir, 1, 2, 1, 2, [("1f1b", {})], cp=2)
    for key in keys:
        check(runs, key, 1, 2, f"cp2 ep2 pp2 {key}")


@pytest.mark.slow
def test_tp2_ep2_pp2_sequence_parallel_equals_the_unsplit_model(mixtral_dir):
    """8 ranks: the experts tp-cut too, dispatched among ranks of one tp rank."""
    runs, keys = _run(mixtral_dir, 2, 2, 2, 2, [("1f1b", {"sequence_parallel": True})])
    for key in keys:
        check(runs, key, 2, 2, f"tp2 ep2 pp2 sp {key}")


def test_what_expert_parallelism_cannot_run_is_refused_naming_the_flag(tmp_path):
    mixtral = write_model(tmp_path / "mixtral", MIXTRAL)
    cfg = TINY.with_flat(seq_len=SEQ).with_hf_model(str(mixtral))
    cfg.with_flat(dp=2, ep=2).validate()
    cfg.with_flat(dp=2, cp=2, ep=4).validate()
    with pytest.raises(ConfigError, match=r"parallelism.ep = 2 \(--ep\) must divide dp \* cp = "
                                          r"3 \* 1 = 3"):
        cfg.with_flat(dp=3, ep=2).validate()
    three = write_model(tmp_path / "three", dict(MIXTRAL, num_local_experts=3))
    with pytest.raises(ConfigError, match=r"3 experts \(model.experts\) are not divisible by ep"):
        TINY.with_flat(seq_len=SEQ).with_hf_model(str(three)).with_flat(dp=2, ep=2).validate()
    with pytest.raises(ConfigError, match=r"the model is dense .*the built-in GPT is dense"):
        TINY.with_flat(dp=2, ep=2).validate()


@pytest.mark.slow
def test_a_plan_with_ep_runs_from_the_cli(mixtral_dir, tmp_path, capfd):
    """pipesim's plan of the Mixtral at ep 2 x dp 2 x pp 2 (--save-plan) runs as it is; the
    first line names ep (both commands run in this process: `cli_helpers.run_pipeexec`)."""
    from pathlib import Path

    from pipesim.cli import main as pipesim_main

    from cli_helpers import run_pipeexec
    plan = tmp_path / "plan.json"
    assert pipesim_main(["simulate", "1f1b", "--model", str(Path(mixtral_dir) / "config.json"),
                         "--seq-len", str(SEQ), "--dp", "2", "--ep", "2", "--pp", "2",
                         "--microbatches", "4", "--precision", "fp32", "--save-plan",
                         str(plan)]) == 0
    out = run_pipeexec(["train", "--plan", str(plan), "--steps", "2", "--device", "cpu"], capfd)
    assert out.returncode == 0, out.stderr
    assert "1f1b ep=2 pp=2 vpp=1 dp=2" in out.stdout + out.stderr
    assert "step 1 (2 of 2)" in out.stdout + out.stderr


@pytest.mark.slow
def test_qwen_moe_families_at_ep2_dp2_equal_the_unsplit_model(tmp_path):
    """Qwen2-MoE (a shared expert and its gate beside the routed experts, replicated) and
    Qwen3-MoE (per-head q/k norms): the same cut of the fused experts, ep 2 x dp 2."""
    from test_hf_moe import MODELS
    dirs = [str(write_model(tmp_path / name, dict(cfg, num_hidden_layers=2)))
            for name, cfg in MODELS.items()]
    frozen = tuple(("1f1b", (("hf_model", d), ("label", name)))
                   for name, d in zip(MODELS, dirs))
    runs = _launch(1, 1, 2, 2, frozen)
    for name in MODELS:
        key = ("1f1b", (("label", name),))
        assert read_hf_config(runs[0][key]["config"].inputs.hf_model).model_type == name
        check(runs, key, 1, 2, f"{name} ep2 dp2")
