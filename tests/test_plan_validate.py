"""Plan: validation errors name field and rule; JSON round trips; rank layout and links."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipesim
from pipesim import Plan, PlanError
from pipesim.plan.cluster import Cluster
from pipesim.plan.parallelism import Parallelism
from pipesim.plan.partition import stage_layers


def plan(model="llama3-8b", hardware="H100", **kw):
    kw.setdefault("global_batch_size", kw.get("dp", 1) * kw.get("micro_batch_size", 1) * 8)
    return Plan.create(model, hardware, **kw)


@pytest.mark.parametrize("kw, field, rule", [
    (dict(model="gpt3-1.3b", tp=3), "parallelism.tp", "heads \\(16\\) must be divisible by tp"),
    (dict(tp=16), "parallelism.tp", "key/value heads \\(8\\) must be divisible by tp \\(16\\)"),
    (dict(ep=2, dp=2), "parallelism.ep", "needs an MoE model"),
    (dict(model="mixtral-8x7b", ep=3, dp=3), "parallelism.ep", "experts \\(8\\) must be divisible by ep"),
    (dict(model="mixtral-8x7b", ep=4, dp=2), "parallelism.ep", "must divide dp \\* cp"),
    (dict(dp=4, micro_batch_size=2, global_batch_size=12), "parallelism.global_batch_size",
     "12 must be divisible by micro_batch_size \\* dp"),
    (dict(cp=3), "parallelism.cp", "divisible by 2 \\* cp = 6"),
    (dict(pp=16, vpp=3), "partition", "32 layers, fewer than pp \\* vpp = 48"),
    (dict(pp=4, vpp=2, schedule="interleaved", global_batch_size=6), "schedule",
     "interleaved"),
    (dict(pp=4, schedule="nonesuch"), "schedule", "unknown schedule"),
    (dict(tp=4, dp=1, gpus_per_node=8, pp=3), "cluster.gpus_per_node", "whole number of 8-GPU nodes"),
    (dict(recompute="full", recompute_layers=40), "parallelism.recompute_layers", "exceeds"),
])
def test_validate_names_field_and_rule(kw, field, rule):
    with pytest.raises(PlanError, match=f"^{field}: .*{rule}"):
        plan(**kw).validate()


def test_bad_values_are_refused_at_construction():
    with pytest.raises(PlanError, match="parallelism.zero"):
        Parallelism(zero=4)
    with pytest.raises(PlanError, match="parallelism.recompute"):
        Parallelism(recompute="some")
    with pytest.raises(PlanError, match="parallelism.tp: must be a positive integer"):
        Parallelism(tp=0)
    with pytest.raises(PlanError, match="plan.efficiency"):
        plan(efficiency=1.5)
    with pytest.raises(PlanError, match="unknown field"):
        Plan.create("llama3-8b", tensor_parallel=2)
    with pytest.raises(ValueError, match="unknown hardware preset"):
        Plan.create("llama3-8b", "H300")


def test_plan_error_is_a_value_error_exported_lazily():
    assert issubclass(pipesim.PlanError, ValueError)
    assert pipesim.Plan is Plan and pipesim.ModelSpec.__name__ == "ModelSpec"


def test_microbatches_and_world():
    p = plan(tp=8, pp=4, dp=8, micro_batch_size=2, global_batch_size=512).validate()
    assert p.microbatches == 32 and p.world_size == 256


def test_repr_is_one_readable_line():
    p = plan(tp=8, pp=2, dp=2, sequence_parallel=True, zero=1)
    text = repr(p)
    assert "\n" not in text and "llama3-8b" in text and "tp=8+sp" in text and "32 x H100" in text


# -- partition ---------------------------------------------------------------------------------
def test_partition_rules_as_megatron():
    assert stage_layers(32, 4) == [8, 8, 8, 8]
    assert stage_layers(30, 4) == [8, 8, 7, 7]
    # account for embedding and loss: 32 + 2 = 34 -> [9, 9, 8, 8] minus one at each end
    assert stage_layers(32, 4, account_for_embedding=True, account_for_loss=True) == [8, 9, 8, 7]
    assert stage_layers(32, 4, first=5, last=6) == [5, 11, 10, 6]
    with pytest.raises(PlanError, match="partition: .* sum to"):
        stage_layers(32, 4, explicit=[8, 8, 8, 7])
    with pytest.raises(PlanError, match="partition: 3 entries"):
        stage_layers(32, 4, explicit=[8, 8, 16])


# -- cluster: Megatron rank order tp -> cp -> dp -> pp -------------------------------------------
def test_groups_know_their_link():
    c = Cluster(pipesim.plan.cluster.get_hardware("H100"), gpus_per_node=8)
    links = c.group_links(Parallelism(tp=8, pp=4, dp=8))
    assert links["tp"].kind == "intra" and links["dp"].kind == "inter" and links["pp"].kind == "inter"
    links = c.group_links(Parallelism(tp=2, cp=2, dp=2, pp=2))    # tp*cp*dp = 8: one node
    assert [links[k].kind for k in ("tp", "cp", "dp", "pp")] == ["intra", "intra", "intra", "inter"]
    links = c.group_links(Parallelism(tp=4, dp=4))                 # dp spans 16 GPUs
    assert (links["tp"].kind, links["dp"].kind) == ("intra", "inter")
    nvl = Cluster(pipesim.plan.cluster.get_hardware("GB200"), gpus_per_node=4)
    assert nvl.domain == 72
    assert nvl.group_links(Parallelism(tp=8, dp=9, pp=2))["dp"].kind == "intra"   # 72 = NVL72
    # dp groups of 64 GPUs: the second one (ranks 64..127) straddles two NVL72 domains
    assert nvl.group_links(Parallelism(tp=8, dp=8, pp=2))["dp"].kind == "inter"


# -- JSON round trips ----------------------------------------------------------------------------
divisors = st.sampled_from([1, 2, 4, 8])


@st.composite
def plans(draw):
    model = draw(st.sampled_from(["llama3-8b", "gpt3-1.3b", "mixtral-8x7b", "tiny"]))
    tp, pp, dp = draw(divisors), draw(st.sampled_from([1, 2, 4])), draw(divisors)
    vpp = draw(st.sampled_from([1, 2]))
    mbs = draw(st.sampled_from([1, 2]))
    m = draw(st.sampled_from([1, 4, 8]))
    kw = dict(tp=tp, pp=pp, dp=dp, vpp=vpp, micro_batch_size=mbs, global_batch_size=mbs * dp * m,
              sequence_parallel=draw(st.booleans()), zero=draw(st.sampled_from([0, 1, 2, 3])),
              recompute=draw(st.sampled_from(["none", "selective", "full"])),
              precision=draw(st.sampled_from(["bf16", "fp16", "fp8"])),
              schedule=draw(st.sampled_from(["1f1b", "interleaved", "zb-h1", "gpipe"])),
              efficiency=draw(st.one_of(st.none(), st.floats(0.1, 1.0))),
              gpus_per_node=draw(st.sampled_from([4, 8])))
    if model == "mixtral-8x7b":
        kw["ep"] = draw(st.sampled_from([e for e in (1, 2, 4, 8) if dp % e == 0]))
    return Plan.create(model, draw(st.sampled_from(["A100", "H100", "B200", "MI300X"])), **kw)


@settings(max_examples=60, deadline=None)
@given(plans())
def test_json_round_trip(p):
    text = p.to_json()
    back = Plan.from_json(text)
    assert back == p
    assert json.loads(back.to_json()) == json.loads(text)


@settings(max_examples=60, deadline=None)
@given(plans())
def test_validate_accepts_exactly_the_plans_the_rules_allow(p):
    """An independent statement of the rules: validate() raises iff one of them fails."""
    m, par = p.model, p.parallelism
    broken = []
    if m.heads % par.tp or m.num_kv_heads % par.tp:
        broken.append("parallelism.tp")
    if m.layers < par.pp * par.vpp:
        broken.append("partition")
    if par.vpp > 1 and p.schedule_name in ("1f1b", "zb-h1", "gpipe"):
        broken.append("schedule")
    if p.schedule_name == "interleaved" and par.vpp > 1 and (
            par.pp < 2 or par.microbatches < par.pp or par.microbatches % par.pp):
        broken.append("schedule")
    if par.world_size > p.cluster.gpus_per_node and par.world_size % p.cluster.gpus_per_node:
        broken.append("cluster")
    if par.precision == "fp8" and p.cluster.hardware.name == "A100":    # no FP8 tensor cores
        broken.append("parallelism.precision")
    try:
        p.validate()
    except PlanError as exc:
        assert broken, f"validate refused a plan breaking no rule: {exc}"
        assert str(exc).split(":")[0].split(".")[0] in {b.split(".")[0] for b in broken}
    else:
        assert not broken, f"validate accepted a plan breaking {broken}"


def test_plan_file_round_trip_with_a_schedule_value(tmp_path):
    s = pipesim.build_schedule("zbv", pp=2, microbatches=4, vpp=2)
    p = plan(model="tiny", pp=2, vpp=2, global_batch_size=4).with_(schedule=s)
    p.to_json(tmp_path / "plan.json")
    back = Plan.from_json(tmp_path / "plan.json")
    assert back == p and back.build_schedule() == s
    with pytest.raises(PlanError, match="unknown plan field"):
        Plan.from_dict({**p.to_dict(), "tpp": 2})
    with pytest.raises(PlanError, match="no such file"):
        Plan.from_json(tmp_path / "nope.json")


def test_megatron_layout_string():
    from pipesim.plan.partition import parse_layout

    # the example of megatron/core/transformer/pipeline_parallel_layer_layout.py (without MTP)
    assert parse_layout("Et*3|(tt|)*29,L", 61, 31) == [3] + [2] * 29 + [0]
    assert parse_layout("Ett|tt|tt|ttL", 8, 4) == [2, 2, 2, 2]
    # a standalone embedding stage, interleaved: 8 virtual stages
    p = plan(model="llama3-8b", pp=4, vpp=2, schedule="interleaved", partition_layout="E|(tttt|)*6t*8L")
    assert p.validate().stage_layers() == [0] + [4] * 6 + [8]
    with pytest.raises(PlanError, match="partition_layout: MTP layers .* last stage only"):
        parse_layout("Et*3|(tt|)*29,m|L", 61, 32)
    # Megatron-Bridge's DeepSeek-V3 layout at pp x vp = 16 (recipes/deepseek/deepseek_v3.py):
    # the embedding and 4 layers, 14 stages of 4, the last layer with the MTP module and loss
    assert parse_layout("Et*4|(t*4|)*14tmL", 61, 16, mtp_layers=1) == [4] * 15 + [1]
    with pytest.raises(PlanError, match="1 MTP layers .* the model has 0"):
        parse_layout("Et*4|(t*4|)*14tmL", 61, 16, mtp_layers=0)
    with pytest.raises(PlanError, match="partition_layout: .* has 3 stages, the plan pp \\* vpp = 4"):
        parse_layout("Ett|tt|ttttL", 8, 4)
    with pytest.raises(PlanError, match="'E' must come once, first"):
        parse_layout("tt|Ett|tt|ttL", 8, 4)
    with pytest.raises(PlanError, match="7 transformer layers"):
        parse_layout("Ett|tt|tt|tL", 8, 4)
    with pytest.raises(PlanError, match="unknown layer character"):
        parse_layout("Exx|tt", 8, 2)
    good = plan(model="llama3-8b", pp=4, partition_layout="Et*5|t*9|t*9|t*9L").validate()
    assert good.stage_layers() == [5, 9, 9, 9]
    assert Plan.from_json(good.to_json()) == good
    r = pipesim.simulate(good)
    assert r.derived.stage_layers == [5, 9, 9, 9]


def test_a100_has_no_fp8_and_an_fp8_plan_on_it_is_refused_with_the_reason(capsys):
    """A100's tensor cores have no FP8: no fp8 peak in `pipesim hardware`, and an fp8 plan on
    it is refused (validate, derive, the planner) naming the precision and the hardware."""
    import pipesim
    from pipesim.cli import main
    from pipesim.errors import PlanError
    from pipesim.hardware import get_hardware

    assert not get_hardware("A100").has_fp8 and get_hardware("A100").fp8_peak_flops == 0
    assert get_hardware("H100").has_fp8 and get_hardware("H100").fp8_peak_flops == 1978e12
    assert main(["hardware"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["A100"][2] == "-" and rows["H100"][2] == "1978.0"
    plan = pipesim.Plan.create("tiny", "A100", schedule="1f1b", pp=2, dp=4,
                               global_batch_size=16, precision="fp8")
    for refuse in (plan.validate, plan.derive):
        with pytest.raises(PlanError, match="parallelism.precision: precision fp8 needs FP8 "
                                            "tensor cores; A100 has none"):
            refuse()
    pipesim.Plan.create("tiny", "H100", schedule="1f1b", pp=2, dp=4, global_batch_size=16,
                        precision="fp8").validate()
    assert main(["plan", "--model", "tiny", "--gpus", "8", "--gbs", "16", "--hardware", "A100",
                 "--precision", "fp8", "--no-progress", "--workers", "1"]) == 1
    assert "A100 has none" in capsys.readouterr().err
