"""``pipeexec train --plan`` runs the plans ``pipesim plan`` picks for a tiny Llama and a tiny
Mixtral on 8 CPU ranks, with context and expert parallelism in the search space, each equal to
one process.

The search is the one ``pipesim plan`` runs (`pipesim.planner.search` over a `SearchSpace`, as
`pipesim.cli.planner_cmds.space_from_args` builds it) on this machine's measured hardware file
(`tests/data/cpu_2core_hardware.json`, written by ``pipeexec calibrate-hardware`` on the
development VM: a stored file keeps the picks deterministic), pricing cp as pipeexec runs it
(``cp_comm="all_gather"``). The search space's defaults hold cp 1, 2, 4 and every ep dividing
the experts and dp x cp. On this CPU cp does not pay (its all-gather's latency and the
attention recomputed in the backward cost more than the GEMMs it halves save), nor, for the
Mixtral, does ep beat the plain layouts, so the test also takes the best plan with cp 2 (and,
for the Mixtral, with ep 2, and with cp 2 and ep 2 together) by the planner's own filters, as
``pipesim plan --cp 2`` would.
Every pick is checked runnable before any process starts (`TrainConfig.validate`, pipeexec's
refusals by name).

Every pick runs 2 steps with ``pipeexec train --plan FILE`` (in-process, 8 forked gloo
workers); its losses equal the unsplit Hugging Face model trained in one process on the same
global batch (`test_hf_models.hf_reference_train`; fp32, rtol 1e-5).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from pipesim.hardware import get_hardware  # noqa: E402
from pipesim.plan.flags import load_model  # noqa: E402
from pipesim.planner.enumerate import SearchSpace  # noqa: E402
from pipesim.planner.search import search  # noqa: E402

from pipeexec.config import TrainConfig  # noqa: E402

from test_hf_models import hf_reference_train, reference_config, write_model  # noqa: E402

HARDWARE = Path(__file__).parent.parent / "data" / "cpu_2core_hardware.json"
GPUS, GBS, SEQ = 8, 8, 256
ADAM_EPS = 1e-5
_DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)
MODELS = {"llama": dict(model_type="llama", **_DECODER),
          "mixtral": dict(model_type="mixtral", **_DECODER, num_local_experts=4,
                          num_experts_per_tok=2)}
TOP = 2          # the planner's best plans run, besides the forced cp / ep ones


def space(directory: Path, **filters) -> SearchSpace:
    model = load_model(directory).with_(seq_length=SEQ)
    return SearchSpace(model, gpus=GPUS, gbs=GBS, hardware=get_hardware(str(HARDWARE)),
                       precision="fp32", cp_comm="all_gather", **filters)


def picks(directory: Path, family: str) -> list:
    """The planner's top plans, then its best with cp 2 (and for the MoE model with ep 2, and
    with both: ep carved out of dp x cp)."""
    out = list(_ranked(space(directory))[:TOP])
    forced = [dict(cp=(2,))] + ([dict(ep=(2,)), dict(cp=(2,), ep=(2,))] if family == "mixtral"
                                else [])
    for filters in forced:
        best = _ranked(space(directory, **filters))
        assert best, f"{family}: no plan fits with {filters}"
        if best[0] not in out:
            out.append(best[0])
    return out


def _ranked(sp: SearchSpace) -> list:
    result = search(sp, workers=1)
    return [result.plans[k] for k in result.ranked["key"]]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("plan-cp-ep")
    return {f: write_model(root / f, cfg) for f, cfg in MODELS.items()}


def test_the_search_space_holds_cp_and_ep_and_prices_cp_as_pipeexec_runs_it(model_dirs):
    """Fast: the defaults search cp and ep (ep dividing the experts and dp x cp), every plan
    carries the all-gather CP, and what the filters force (cp 2; ep 2, with ZeRO too) is what
    pipeexec runs."""
    from pipesim.planner.enumerate import enumerate_plans

    plans = enumerate_plans(space(model_dirs["mixtral"])).plans
    par = [p.parallelism for p in plans]
    assert {p.cp for p in par} == {1, 2, 4} and {p.ep for p in par} == {1, 2, 4}
    assert all((p.dp * p.cp) % p.ep == 0 and 4 % p.ep == 0 for p in par)
    assert {p.cp_comm for p in par} == {"all_gather"}
    cp_best = _ranked(space(model_dirs["llama"], cp=(2,)))[0]
    assert cp_best.parallelism.cp == 2
    TrainConfig(plan=cp_best).validate()
    ep_zero = _ranked(space(model_dirs["mixtral"], ep=(2,), zero=(1,)))[0]
    assert (ep_zero.parallelism.ep, ep_zero.parallelism.zero) == (2, 1)
    TrainConfig(plan=ep_zero).validate()


def _trained(tmp: Path, plan, directory: Path, name: str) -> tuple[list[float], TrainConfig]:
    from pipeexec.cli.main import main

    path, metrics = tmp / f"{name}.json", tmp / f"{name}-metrics.json"
    plan.to_json(path)
    assert main(["train", "--plan", str(path), "--steps", "2", "--eps", str(ADAM_EPS),
                 "--no-progress", "--metrics-out", str(metrics)]) in (0, None)
    recorded = json.loads(metrics.read_text())
    return recorded["losses"], TrainConfig.from_dict(recorded["config"])


@pytest.mark.slow
@pytest.mark.parametrize("family", MODELS)
def test_pipeexec_runs_every_plan_the_planner_picks_on_8_cpu_ranks(tmp_path, model_dirs, family):
    directory = model_dirs[family]
    chosen = picks(directory, family)
    assert any(p.parallelism.cp > 1 for p in chosen)
    assert family != "mixtral" or any(p.parallelism.ep > 1 for p in chosen)
    for i, plan in enumerate(chosen):
        TrainConfig(plan=plan).validate()        # before any process: what pipeexec runs
        losses, cfg = _trained(tmp_path, plan, directory, f"{family}-{i}")
        par = plan.parallelism
        what = f"{family} {plan.schedule_name} {par.short()}"
        ran = cfg.plan.parallelism
        assert (cfg.world_size, ran.cp, ran.ep, ran.dp, ran.pp) == \
            (GPUS, par.cp, par.ep, par.dp, par.pp), what
        ref = reference_config(cfg.with_flat(hf_model=str(directory))).with_flat(
            cp=1, ep=1, tp=1, sequence_parallel=False, zero=0, recompute="none")
        ref_losses, _ = hf_reference_train(ref)
        assert losses == pytest.approx(ref_losses, rel=1e-5), what


# -- compare: cp 2 and ep 2 plans predicted from a cp 1 / ep 1 run, collectives measured -------
def _compare(tmp: Path, plan, name: str, *extra: str) -> dict:
    from pipeexec.cli.compare import compare_main

    path, report = tmp / f"{name}.json", tmp / f"{name}-report.json"
    plan.to_json(path)
    assert compare_main(["--plan", str(path), "--steps", "4", "--profile", "1:4",
                         "--cpus-per-rank", "0.25", "--report-out", str(report), *extra]) == 0
    return json.loads(report.read_text())


@pytest.mark.slow
def test_compare_predicts_cp_and_ep_plans_with_their_collectives_from_the_hardware_file(
        tmp_path, model_dirs):
    """``pipeexec compare --plan P --calibrate-from RUN --hardware FILE`` for a cp 2 plan (the
    built-in GPT, pp 2, 4 ranks) from a cp 1 run, and an ep 2 plan (the tiny Mixtral, pp 2 x
    dp 2) from an ep 1 run: the report holds the prediction, the carried layouts, and each
    rank's cp (ep) collective seconds, non-zero, priced from the file; the table's
    <group>_collectives_predicted columns per rank. No bound on the times (a shared CPU)."""
    gpt = TrainConfig.from_flat(layers=4, hidden=32, heads=4, seq_len=64, vocab=64, pp=2,
                                microbatches=4, micro_batch_size=2).plan
    moe = TrainConfig.from_flat(pp=2, dp=2, microbatches=4, micro_batch_size=2,
                                seq_len=32).with_hf_model(str(model_dirs["mixtral"])).plan
    for name, base, group in (("gpt", gpt, "cp"), ("mixtral", moe, "ep")):
        trace = tmp_path / f"{name}-1-trace.json"
        own = _compare(tmp_path, base, f"{name}-1", "--trace-out", str(trace))
        assert own["predicted_collectives"] == {}           # its own trace holds them
        two = _compare(tmp_path, base.with_(**{group: 2}), f"{name}-2", "--calibrate-from",
                       str(trace), "--hardware", str(HARDWARE))
        src = two["calibration"]["source"]
        assert (src["carried_from"], src["carried_to"]) == (
            "tp 1 cp 1 ep 1", f"tp 1 cp {2 if group == 'cp' else 1} ep {2 if group == 'ep' else 1}")
        assert src["hardware"] == get_hardware(str(HARDWARE)).name
        coll = two["predicted_collectives"]
        assert set(coll) == {"tp", "cp", "ep"} and len(coll[group]) == 2, name
        assert all(x > 0 for x in coll[group]), (name, coll)
        other = "ep" if group == "cp" else "cp"
        assert coll["tp"] == coll[other] == [0.0, 0.0], (name, coll)
        for row in two["per_rank"]:
            assert row[f"{group}_collectives_predicted"] == coll[group][row["rank"]]
        assert two["predicted_step_time"] > 0 and two["measured_step_time"] > 0
