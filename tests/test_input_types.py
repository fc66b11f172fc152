"""Values of the wrong JSON type, out of range or too large are refused, naming the field.

JSON's types are not Python's: ``true`` is not the integer 1, ``1.0`` is not an integer and the
string ``"false"`` is not false (Python's ``bool("false")`` is True). A plan file or a Hugging
Face config.json holding such a value was read as another run (sequence parallelism on, tied
embeddings, ZeRO 1, full attention for 0 kv heads); each is refused here with the field, the
type it needs and the type it got. Torch-free (pipesim's readers), but for the last tests,
which run pipeexec's command line up to its refusal (no worker starts)."""
from __future__ import annotations

import json
import math

import pytest

import pipesim
from pipesim.errors import PlanError, ScheduleError
from pipesim.fields import json_value
from pipesim.plan.model import ModelSpec
from pipesim.schedule.registry import MAX_ACTIONS_PER_RANK


def _plan_dict() -> dict:
    return json.loads(pipesim.Plan.create("llama3-8b", "H100", pp=2, global_batch_size=8)
                      .to_json())


# (section of the plan, field, wrong value, the type named in the refusal)
WRONG = [
    ("parallelism", "sequence_parallel", "false", "true or false"),
    ("model", "tied_embeddings", "false", "true or false"),
    ("parallelism", "zero", True, "an integer"),
    ("parallelism", "zero", 1.0, "an integer"),
    ("parallelism", "tp", "2", "an integer"),
    ("parallelism", "global_batch_size", 1e12, "an integer"),
    ("parallelism", "recompute", 0, "a string"),
    ("model", "layers", 32.0, "an integer"),
    ("model", "bias", 1, "true or false"),
    (None, "partition", "13", "a JSON array"),
    (None, "first_stage_layers", "2", "an integer"),
    (None, "schedule", 5, "a schedule name"),
    (None, "account_for_loss", "false", "true or false"),
    (None, "efficiency", math.nan, "a finite number"),
]


@pytest.mark.parametrize("section,field,value,needs", WRONG,
                         ids=[f"{f}={v!r}" for _, f, v, _ in WRONG])
def test_a_plan_value_of_the_wrong_json_type_is_refused(section, field, value, needs, tmp_path):
    data = _plan_dict()
    (data[section] if section else data)[field] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError) as info:
        pipesim.Plan.from_json(path)
    msg = str(info.value)
    assert str(path) in msg and field in msg and needs in msg and repr(value) in msg, msg


def test_the_right_types_still_read():
    data = _plan_dict()
    data["parallelism"].update(sequence_parallel=False, zero=1, tp=2)
    data.update(partition=[16, 16], first_stage_layers=None)
    plan = pipesim.Plan.from_dict(data)
    assert (plan.parallelism.zero, plan.parallelism.sequence_parallel, plan.partition) == \
        (1, False, (16, 16))
    assert pipesim.Plan.from_dict(json.loads(plan.to_json())) == plan


def test_a_partition_entry_of_the_wrong_type_is_refused():
    data = _plan_dict()
    data["partition"] = [16, "16"]
    with pytest.raises(PlanError, match=r"plan.partition\[1\] must be an integer, got '16'"):
        pipesim.Plan.from_dict(data)


def test_json_value_reads_json_types_not_pythons():
    assert json_value(3, "int", "n", "f") == 3
    for value in (True, 3.0, "3", None):
        with pytest.raises(ValueError, match="n must be an integer"):
            json_value(value, "int", "n", "f")
    for value in ("false", 0, 1, None):
        with pytest.raises(ValueError, match="n must be true or false"):
            json_value(value, "bool", "n", "f")
    for value in (math.nan, math.inf, True, "1.5"):
        with pytest.raises(ValueError, match="n must be a finite number"):
            json_value(value, "number", "n", "f")
    assert json_value(None, "int", "n", "f", optional=True) is None
    with pytest.raises(ValueError, match="n must be > 0, got 0"):
        json_value(0, "number", "n", "f", low=0, strict=True)


def test_unknown_schedule_options_are_refused_naming_the_known_ones():
    data = _plan_dict()
    data["schedule_options"] = {"bogus": 1}
    plan = pipesim.Plan.from_dict(data)
    with pytest.raises(PlanError, match="unknown schedule option.s. bogus; it takes no options"):
        plan.build_schedule()
    with pytest.raises(ScheduleError, match="unknown schedule option.s. bogus; known options: "
                                            "costs, memory_limit"):
        pipesim.build_schedule("zb-auto", pp=2, microbatches=4, bogus=1)


def test_a_binary_plan_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "plan.json"
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    with pytest.raises(PlanError, match=f"{path}: not a plan file: byte 0 is 0x89, not UTF-8"):
        pipesim.Plan.from_json(path)


# -- sizes that cannot be built ----------------------------------------------------------------
def test_a_schedule_beyond_the_bound_is_refused_before_it_is_built():
    m = MAX_ACTIONS_PER_RANK // 3 + 1        # the first count past the bound (F, B, W each)
    with pytest.raises(ScheduleError, match="MAX_ACTIONS_PER_RANK"):
        pipesim.build_schedule("1f1b", pp=2, microbatches=m)
    with pytest.raises(ScheduleError, match="100,000,000 microbatches"):
        pipesim.build_schedule("1f1b", pp=2, microbatches=100_000_000)
    s = pipesim.build_schedule("1f1b", pp=2, microbatches=m - 1)     # at the bound: built
    assert max(len(s.compute_order(r)) for r in range(2)) <= MAX_ACTIONS_PER_RANK


def test_simulate_refuses_a_plan_of_a_trillion_sequences(tmp_path, capsys):
    from pipesim.cli import main
    plan = pipesim.Plan.create("llama3-8b", "H100", pp=4, global_batch_size=10 ** 12)
    plan.to_json(tmp_path / "big.json")
    assert main(["simulate", "--plan", str(tmp_path / "big.json")]) == 2
    assert "MAX_ACTIONS_PER_RANK" in capsys.readouterr().err


# -- Hugging Face config.json ------------------------------------------------------------------
LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
             max_position_embeddings=64)
# (change, the key the refusal names, whether transformers' own LlamaConfig refuses it too)
HF_WRONG = [
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false", True),
    ({"num_key_value_heads": 0}, "num_key_value_heads must be >= 1", False),
    ({"rms_norm_eps": -1}, "rms_norm_eps must be > 0", False),
    ({"rope_theta": math.nan}, "rope_theta must be a finite number", False),
    ({"hidden_size": -64}, "hidden_size must be >= 1", False),
    ({"num_hidden_layers": 0}, "num_hidden_layers must be >= 1", False),
    ({"num_attention_heads": 5}, "hidden_size = 64 is not a multiple of num_attention_heads = 5",
     True),
    ({"head_dim": 7}, "head_dim = 7 is odd", True),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads = 3", False),
    ({"hidden_act": "nonsense"}, "hidden_act 'nonsense' is not an activation", False),
    ({"intermediate_size": 128.0}, "intermediate_size must be an integer", False),
]


@pytest.mark.parametrize("change,message,transformers_refuses", HF_WRONG,
                         ids=[next(iter(c)) + "=" + repr(next(iter(c.values())))
                              for c, _, _ in HF_WRONG])
def test_an_hf_config_value_of_the_wrong_type_or_range_is_refused(change, message,
                                                                   transformers_refuses,
                                                                   tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA, **change}))
    with pytest.raises(PlanError) as info:
        ModelSpec.from_hf_config(path)
    assert str(path) in str(info.value) and message in str(info.value)
    if transformers_refuses:      # the peer library's own validators agree
        transformers = pytest.importorskip("transformers")
        with pytest.raises(Exception):
            transformers.LlamaConfig(**{k: v for k, v in {**LLAMA, **change}.items()
                                        if k != "model_type"})


def test_a_good_hf_config_still_reads():
    spec = ModelSpec.from_hf_config({**LLAMA, "tie_word_embeddings": True, "rms_norm_eps": 1e-5,
                                     "num_key_value_heads": None})
    assert spec.tied_embeddings is True and spec.num_kv_heads == 4


# -- pipeexec's readers: the same refusals, before any worker starts -----------------------------
def _train(argv, capsys):
    pytest.importorskip("torch")
    from pipeexec.cli.train import train_main
    with pytest.raises(SystemExit) as info:
        train_main(argv)
    return info.value.code, capsys.readouterr().err


def test_pipeexec_refuses_a_plan_value_of_the_wrong_type(tmp_path, capsys):
    from pipeexec.config import TrainConfig
    data = TrainConfig.from_flat(pp=1).plan.to_dict()
    data["parallelism"]["sequence_parallel"] = "false"
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    code, err = _train(["--plan", str(path)], capsys)
    assert code == 2 and "sequence_parallel must be true or false" in err and str(path) in err


def test_pipeexec_refuses_a_trillion_microbatches_before_building(capsys):
    code, err = _train(["--microbatches", "100000000"], capsys)
    assert code == 2 and "MAX_ACTIONS_PER_RANK" in err


def test_pipeexec_refuses_an_hf_config_of_the_wrong_type(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "tie_word_embeddings": "false"}))
    code, err = _train(["--hf-model", str(tmp_path), "--seq-len", "8"], capsys)
    assert code == 2 and "tie_word_embeddings must be true or false" in err


# -- model values out of range -----------------------------------------------------------------
@pytest.mark.parametrize("change,message", [
    ({"heads": 5}, "model.heads: hidden (64) is not a multiple of heads (5)"),
    ({"head_dim": 7, "position": "rotary"}, "model.head_dim: 7 is odd"),
    ({"hidden": 0}, "model.hidden: must be a positive integer, got 0"),
    ({"kv_heads": -2}, "model.kv_heads: must be a positive integer, got -2"),
    ({"vocab": 0}, "model.vocab: must be a positive integer"),
])
def test_a_model_shape_that_cannot_be_is_refused_naming_the_field(change, message):
    data = ModelSpec("m", layers=2, hidden=64, heads=4, seq_length=32, vocab=256).to_dict()
    with pytest.raises(PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelSpec.from_dict({**data, **change})


def test_a_head_dim_of_its_own_still_reads():
    # Qwen3-style heads wider than hidden / heads (given as head_dim) are a model, not an error
    spec = ModelSpec("m", layers=2, hidden=64, heads=4, seq_length=32, vocab=256, head_dim=32,
                     position="rotary")
    assert spec.q_size == 128


@pytest.mark.parametrize("suffix", [".json", ".csv"])
def test_a_binary_schedule_file_is_refused_naming_it(tmp_path, suffix):
    from pipesim.schedule.io import schedule_from_csv, schedule_from_json
    path = tmp_path / f"schedule{suffix}"
    path.write_bytes(b"\xff\xfe" + bytes(range(256)))
    read = schedule_from_json if suffix == ".json" else schedule_from_csv
    with pytest.raises(ScheduleError, match=f"{path}: not a schedule file: byte 0 is 0xff"):
        read(path)


def test_pipeexec_refuses_a_binary_schedule_file_naming_it(tmp_path, capsys):
    path = tmp_path / "schedule.json"
    path.write_bytes(bytes(range(128, 256)))
    code, err = _train(["--schedule", str(path)], capsys)
    assert code == 2 and f"{path}: not a schedule file" in err


def test_pipeexec_refuses_a_plan_whose_hf_config_is_out_of_range(tmp_path, capsys):
    """A plan made from a config.json carries it (model.hf_config): a bad value there is
    refused before any worker, not as transformers' validator line inside one."""
    from pipeexec.config import TrainConfig
    model = ModelSpec.from_hf_config({**LLAMA, "rms_norm_eps": 1e-5}, seq_length=8)
    data = TrainConfig.from_flat(pp=1).plan.to_dict()
    data["model"] = {**model.to_dict(), "vocab_divisible_by": 1,
                     "hf_config": {**model.hf_config, "rms_norm_eps": -1.0}}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    code, err = _train(["--plan", str(path)], capsys)
    assert code == 2 and "rms_norm_eps must be > 0, got -1.0" in err, err
