"""What a new user meets on pipesim's command line: Ctrl-C, notes that keep a table from
misleading, and help that lists what exists."""
from __future__ import annotations

import pytest

from pipesim.cli import main
from pipesim.hardware import hardware_names


def test_ctrl_c_in_a_long_pipesim_command_prints_one_line_and_exits_130(monkeypatch, capsys):
    import importlib

    search_module = importlib.import_module("pipesim.planner.search")
    sweep_module = importlib.import_module("pipesim.sim.sweep")   # pipesim.sim.sweep is also a function

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(search_module, "search", interrupted)
    monkeypatch.setattr(sweep_module, "sweep", interrupted)
    for argv in (["plan", "--model", "tiny", "--gpus", "8", "--gbs", "16", "--no-progress"],
                 ["sweep", "--schedules", "1f1b", "--out", "s.csv", "--no-progress"]):
        assert main(argv) == 130
        captured = capsys.readouterr()
        assert captured.err.strip() == f"pipesim {argv[0]}: interrupted", captured.err


def test_a_pool_worker_leaves_ctrl_c_to_the_parent():
    import signal
    from concurrent.futures import ProcessPoolExecutor

    from pipesim.planner.search import _ignore_sigint

    with ProcessPoolExecutor(1, initializer=_ignore_sigint) as pool:
        assert pool.submit(signal.getsignal, signal.SIGINT).result() == signal.SIG_IGN


def test_sweep_says_default_costs_are_per_stage_when_vpp_exceeds_1(tmp_path, capsys):
    argv = ["sweep", "--schedules", "1f1b", "zbv", "--pp", "2", "-m", "8", "--vpp", "1", "2",
            "--out", str(tmp_path / "s.csv"), "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "note: makespans at vpp > 1 are not comparable with vpp = 1's here: the default " \
           "costs are per stage" in out
    assert main(argv[:4] + ["--pp", "2", "-m", "8", "--out", str(tmp_path / "t.csv"),
                            "--no-progress"]) == 0
    assert "note:" not in capsys.readouterr().out        # vpp 1 alone: nothing to warn of


@pytest.mark.parametrize("command", ["sweep", "simulate"])
def test_help_lists_every_hardware_preset(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert ", ".join(hardware_names()) in text
    assert len(hardware_names()) >= 6


def test_the_interleaved_remainder_hint_names_a_flag_that_exists(capsys):
    assert main(["simulate", "interleaved", "--pp", "4", "--vpp", "2", "-m", "6"]) == 2
    err = capsys.readouterr().err
    assert "microbatch counts (--microbatches) that work with group size 4: 4, 8, 12" in err
    assert "build_schedule(..., microbatch_group_size=G)" in err
