"""`pipesim simulate` with a plan (flags or --plan), `pipesim models`, `pipesim hardware`."""
import json

import pytest

import pipesim
from pipesim.cli import main

FLAGS = ["simulate", "interleaved", "--model", "llama3-70b", "--tp", "8", "--cp", "1", "--pp", "4",
         "--vpp", "5", "--dp", "8", "--micro-batch-size", "1", "--global-batch-size", "512",
         "--seq-len", "8192", "--recompute", "selective", "--sequence-parallel",
         "--distributed-optimizer", "--hardware", "H100", "--gpus-per-node", "8"]


def test_simulate_plan_flags_report_and_plan_file(tmp_path, capsys):
    report, plan_file = tmp_path / "r.json", tmp_path / "p.json"
    assert main(FLAGS + ["--report-out", str(report), "--save-plan", str(plan_file)]) == 0
    out = capsys.readouterr().out
    assert "MFU" in out and "fits" in out and "tokens/s/GPU" in out
    data = json.loads(report.read_text())
    for key in ("step_time", "tokens_per_s_per_gpu", "mfu", "hfu", "peak_memory",
                "memory_breakdown", "fits"):
        assert key in data
    assert len(data["peak_memory"]) == 4 and data["fits"] is True
    plan = pipesim.Plan.from_json(plan_file)
    expected = pipesim.Plan.create("llama3-70b", "H100", schedule="interleaved", tp=8, pp=4, vpp=5,
                                   dp=8, global_batch_size=512, recompute="selective",
                                   sequence_parallel=True, zero=1)
    assert plan == expected
    assert data["step_time"] == pytest.approx(pipesim.simulate(expected).step_time)
    # the same plan from the file; flags given on the line override its fields
    report2 = tmp_path / "r2.json"
    assert main(["simulate", "--plan", str(plan_file), "--report-out", str(report2)]) == 0
    assert json.loads(report2.read_text())["step_time"] == data["step_time"]
    assert main(["simulate", "--plan", str(plan_file), "--pp", "8", "--tp", "4",
                 "--report-out", str(report2)]) == 0
    p2 = json.loads(report2.read_text())["plan"]["parallelism"]
    assert (p2["pp"], p2["tp"], p2["vpp"], p2["dp"]) == (8, 4, 5, 8)


def test_simulate_plan_from_hf_config_and_zero(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816,
                               "num_attention_heads": 16, "num_key_value_heads": 4,
                               "num_hidden_layers": 8, "vocab_size": 32000,
                               "max_position_embeddings": 2048}))
    report = tmp_path / "r.json"
    assert main(["simulate", "1f1b", "--model", str(cfg), "--tp", "2", "--pp", "2", "--dp", "2",
                 "--zero", "3", "--global-batch-size", "16", "--report-out", str(report)]) == 0
    data = json.loads(report.read_text())
    assert data["plan"]["parallelism"]["zero"] == 3
    assert data["plan"]["model"]["kv_heads"] == 4
    assert data["memory_breakdown"][0]["buffers"] > 0        # ZeRO-3's gathered layers


def test_plan_errors_are_reported_with_field_and_rule(capsys):
    assert main(["simulate", "1f1b", "--model", "llama3-70b", "--tp", "3"]) == 2
    assert "parallelism.tp: attention heads (64) must be divisible by tp (3)" in capsys.readouterr().err
    assert main(["simulate", "1f1b", "--model", "llama3-8b", "--zero", "2",
                 "--distributed-optimizer"]) == 2
    assert "contradicts --zero 2" in capsys.readouterr().err


def test_legacy_simulate_flags_unchanged(capsys):
    assert main(["simulate", "1f1b", "--model", "gpt3-1.3b", "--pp", "4", "-m", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("1f1b: pp=4 vpp=1 microbatches=8") and "MFU" not in out


def test_models_and_hardware_listings(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "llama3-405b" in out and "405.85B" in out and "mixtral-8x7b" in out
    assert main(["hardware"]) == 0
    out = capsys.readouterr().out
    for name in ("A100", "H100", "H200", "B200", "GB200", "MI300X"):
        assert name in out
    assert main(["hardware", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["GB200"]["nvlink_domain"] == 72
