"""One byte parser for every command line: sizes need their unit and must be positive."""
import pytest

from pipesim.units import byte_unit, parse_bytes

GiB = 2 ** 30


@pytest.mark.parametrize("text,want", [("80GiB", 80 * GiB), ("80 GB", 80e9), ("1.5TiB", 1.5 * 2 ** 40),
                                       ("123B", 123.0), ("512MiB", 512 * 2 ** 20), ("8e10B", 8e10),
                                       ("2kb", 2e3), (4096, 4096.0), (1.5e9, 1.5e9)])
def test_parse_bytes(text, want):
    assert parse_bytes(text) == want


@pytest.mark.parametrize("text,why", [("80", "needs its unit"), ("8e10", "needs its unit"),
                                      ("80 parsecs", "not a size"), ("GiB", "not a size"),
                                      ("", "not a size"), ("-5GB", "not a size"),
                                      ("0GB", "must be > 0"), ("0B", "must be > 0"), (0, "must be > 0"),
                                      (-3.0, "must be > 0")])
def test_parse_bytes_refuses_with_the_units(text, why):
    with pytest.raises(ValueError, match=why) as info:
        parse_bytes(text)
    if why != "must be > 0":
        assert "GiB" in str(info.value) and "GB" in str(info.value)


def test_byte_unit():
    assert byte_unit(3 * GiB) == (GiB, "GiB")
    assert byte_unit(2 ** 20) == (2 ** 20, "MiB")
    assert byte_unit(100) == (1.0, "bytes")


@pytest.mark.parametrize("size", ["80", "0GB", "-5GB"])
def test_every_cli_refuses_a_size_without_unit_or_not_positive(size, tmp_path, capsys):
    """The four commands that take a memory size read it with the one parser, and refuse before
    anything runs (argparse's usage error: exit status 2, the reason named)."""
    from pipesim.cli import main as pipesim_main

    commands = [
        ["simulate", "zb-auto", "--pp", "2", "-m", "4", f"--memory-limit={size}"],
        ["sweep", "--schedules", "1f1b", "--pp", "2", "--out", str(tmp_path / "s.csv"),
         "--no-progress", f"--memory-limit={size}"],
        ["plan", "--model", "tiny", "--gpus", "8", "--gbs", "16", f"--memory-limit={size}",
         "--out", str(tmp_path / "p.csv")],
    ]
    for argv in commands:
        with pytest.raises(SystemExit) as info:
            pipesim_main(argv)
        assert info.value.code == 2, argv
        err = capsys.readouterr().err
        assert "memory size" in err and ("unit" in err or "> 0" in err or "not a size" in err), err
    pytest.importorskip("torch")
    from pipeexec.cli import main as pipeexec_main

    with pytest.raises(SystemExit) as info:
        pipeexec_main(["train", "--schedule", "zb-auto", "--pp", "2", f"--memory-limit={size}"])
    assert info.value.code == 2
    assert "memory size" in capsys.readouterr().err


def test_numbers_print_for_people():
    """No 1e+07 bytes, 0.000181B or 5.55112e-17 in what a user reads."""
    import pipesim
    from pipesim.units import format_bytes, format_count, format_number

    assert format_bytes(1e7) == "9.54 MiB" and format_bytes(2.51088e6) == "2.39 MiB"
    assert format_bytes(512) == "512 bytes" and format_bytes(80 * 2 ** 30) == "80 GiB"
    assert format_count(181_000) == "181k" and format_count(70.55e9) == "70.5B"
    assert format_count(12) == "12"
    assert format_number(5.55112e-17, zero_below=1e-9) == "0"
    assert format_number(32.2996) == "32.2996"
    plan = pipesim.Plan.create("tiny", "A100", schedule="1f1b", pp=2, dp=4, global_batch_size=16)
    assert repr(plan).startswith("Plan(tiny 41.9M seq=512")
    with pytest.raises(pipesim.ScheduleError) as info:
        pipesim.build_schedule("zb-auto", pp=2, microbatches=4, memory_limit=1e7,
                               costs=pipesim.CostModel.transformer("gpt3-6.7b", "H100",
                                                                   num_stages=2))
    assert "memory_limit 9.54 MiB on rank 0" in str(info.value) and "e+" not in str(info.value)


def test_a_zero_bubble_prints_as_zero_not_as_rounding_noise():
    import pipesim

    r = pipesim.simulate(pipesim.build_schedule("zbv", pp=4, vpp=2, microbatches=8),
                         pipesim.CostModel.uniform())
    text = r.summary_text(unitless=True)
    assert "e-1" not in text and "e-2" not in text, text


def test_a_model_spec_prints_its_parameters_for_people():
    from pipesim.plan.model import get_model

    assert "params=41.9M" in repr(get_model("tiny"))
    assert "params=70.6B" in repr(get_model("llama3-70b"))


def test_a_column_of_step_times_prints_at_one_precision():
    from pipesim.cli.planner_cmds import ranking_text
    from pipesim.units import column_decimals

    assert column_decimals([7.189, 7.6, 24.94]) == 3
    assert column_decimals([0.0145, 0.02]) == 5          # 14.5 ms: 0.01450
    assert column_decimals([]) == 3 and column_decimals([0.0]) == 3
    import pandas as pd

    ranked = pd.DataFrame({"tokens_per_s_per_gpu": [1000.0, 900.0], "mfu": [0.5, 0.45],
                           "step_time": [7.189, 7.6], "bubble_fraction": [0.01, 0.02],
                           "peak_memory": [2.0 ** 30, 2.0 ** 31], "headroom": [2.0 ** 30] * 2,
                           "key": ["a", "b"]})
    rows = ranking_text(ranked).splitlines()[1:]
    assert [r.split()[3] for r in rows] == ["7.189", "7.600"]


def test_the_ranking_counts_twins_and_prints_memory_in_a_unit_that_fits():
    """Plans of the same step time and memory (cp 1 mbs 1 = cp 2 mbs 2 ...) are one row with
    their twins counted; a tiny model's peaks print in MiB, not as "0.0 GiB"."""
    import pandas as pd

    from pipesim.cli.planner_cmds import ranking_text

    mib = 2.0 ** 20
    ranked = pd.DataFrame({"tokens_per_s_per_gpu": [1000.0, 1000.0, 1000.0, 900.0],
                           "mfu": [0.5] * 3 + [0.45], "step_time": [0.0127] * 3 + [0.014],
                           "bubble_fraction": [0.01] * 4,
                           "peak_memory": [3 * mib] * 3 + [2 * mib], "headroom": [mib] * 4,
                           "key": ["cp1 mbs1", "cp2 mbs2", "cp4 mbs4", "other"]})
    head, *rows = ranking_text(ranked).splitlines()
    assert "peak MiB" in head and len(rows) == 2
    assert rows[0].split()[5] == "3.0" and "(+2 twins of the same time and memory: cp2 mbs2, cp4 mbs4)" in rows[0]
    assert rows[1].split()[0] == "2" and rows[1].endswith("other")
    assert len(ranking_text(ranked, top=1).splitlines()) == 2
