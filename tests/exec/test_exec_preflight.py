"""``pipeexec train`` checks everything it can before a worker starts, and says what the user
did: a bad learning rate, a CPU share the machine lacks, a data file that is not text, a
resumed run with nothing left to train, an iteration that was never saved; Ctrl-C ends a run
with one line and status 130."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from pipeexec.cli.main import main
from pipeexec.config import ConfigError, TrainConfig
from pipeexec.run.preflight import check_cpus_per_rank, data_warning

TINY = ["--layers", "1", "--hidden", "16", "--heads", "2", "--seq-len", "8", "--vocab", "256",
        "--no-progress"]


def run_cli(argv):
    with pytest.raises(SystemExit) as info:
        main(argv)
    return info.value.code


@pytest.mark.parametrize("field, value, match", [
    ("lr", -1.0, "lr must be a finite number >= 0"),
    ("lr", float("nan"), "lr must be a finite number"),
    ("min_lr", 1.0, "min_lr must be .* at most --lr"),
    ("weight_decay", -0.1, "weight_decay"),
    ("clip_grad", -1.0, "clip_grad"),
    ("warmup_steps", -2, "warmup_steps must be an integer >= 0"),
    ("decay_steps", 0, "decay_steps must be a positive integer"),
    ("loss_scale", 0.0, "loss_scale must be a finite number > 0"),
])
def test_config_refuses_bad_optimisation_values(field, value, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig.from_flat(**{field: value}).validate()


def test_bad_lr_fails_before_any_worker(capsys, monkeypatch):
    import pipeexec.launching.launcher as launcher

    monkeypatch.setattr(launcher, "launch", lambda *a, **k: pytest.fail("a worker started"))
    assert run_cli(["train", *TINY, "--lr", "-1"]) == 2
    assert "lr must be a finite number >= 0 (--lr), got -1.0" in capsys.readouterr().err


def test_cpus_per_rank_beyond_the_machine_is_refused(capsys):
    check_cpus_per_rank(0.5, 4, available=2.0)
    with pytest.raises(ConfigError, match=r"asks for 20 CPUs, but this process may use 2 .* "
                                          r"at most --cpus-per-rank 0.5"):
        check_cpus_per_rank(5, 4, available=2.0)
    with pytest.raises(ConfigError, match="at most --cpus-per-rank 0.5"):
        check_cpus_per_rank(1, 4, available=2.0)          # the ranks would compete
    too_many = str(float(os.cpu_count() or 1) + 1)
    assert run_cli(["train", *TINY, "--cpus-per-rank", too_many]) == 2
    assert f"--cpus-per-rank {float(too_many):g} for 1 rank(s)" in capsys.readouterr().err


def test_data_that_is_not_text_is_named(tmp_path):
    png = tmp_path / "x.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" + bytes(range(256)) * 4)
    assert "NUL bytes" in data_warning(str(png))
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9 ".encode("latin-1") * 100)
    assert "not UTF-8 text (byte 3 is 0xe9)" in data_warning(str(latin))
    js = tmp_path / "d.json"
    js.write_text('{"a": [1, 2, 3]}' * 10)
    assert "looks like JSON" in data_warning(str(js))
    prose = tmp_path / "prose.txt"
    prose.write_text("Über alles: a line of prose. " * 100)
    assert data_warning(str(prose)) is None and data_warning("synthetic") is None


def test_missing_data_file_is_a_config_error():
    with pytest.raises(ConfigError, match="data: file 'nope.txt' does not exist"):
        TrainConfig.from_flat(data="nope.txt").validate()


@pytest.fixture(scope="module")
def checkpoint_at_4(tmp_path_factory):
    ck = tmp_path_factory.mktemp("ck") / "ck"
    main(["train", *TINY, "--steps", "4", "--save", str(ck), "--save-interval", "2"])
    return ck


def test_resume_with_nothing_to_train_says_so(checkpoint_at_4, capsys, monkeypatch):
    import pipeexec.launching.launcher as launcher

    capsys.readouterr()
    monkeypatch.setattr(launcher, "launch", lambda *a, **k: pytest.fail("a worker started"))
    assert run_cli(["train", *TINY, "--steps", "3", "--load", str(checkpoint_at_4)]) == 0
    out = capsys.readouterr().out
    assert "nothing to train: the checkpoint in" in out and "is at iteration 4" in out
    assert "pass --steps 7 to train 3 more" in out


def test_ckpt_step_that_was_never_saved_lists_the_saved_ones(checkpoint_at_4, capsys):
    capsys.readouterr()
    assert run_cli(["train", *TINY, "--steps", "8", "--load", str(checkpoint_at_4),
                    "--ckpt-step", "99"]) == 1
    err = capsys.readouterr().err
    assert "no checkpoint of iteration 99" in err and "iterations saved there: 2, 4" in err
    assert "tracker" not in err.split("--ckpt-step")[0]


@pytest.mark.slow
def test_ctrl_c_stops_the_workers_with_one_line():
    code = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "from pipeexec.cli import main; main()")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen([sys.executable, "-c", code, "train", "--pp", "2", "--microbatches", "2",
                          "--steps", "1000000", *TINY], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)
    try:
        line = p.stdout.readline()
        assert line.startswith("pipeexec:"), line                # the banner
        while line.startswith("pipeexec:"):                     # ... and its version lines
            line = p.stdout.readline()
        assert line.startswith("step 0 (1 of"), line            # the workers run
        os.killpg(p.pid, signal.SIGINT)                         # what a terminal's Ctrl-C does
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130, err
    assert err.strip() == "pipeexec: interrupted: stopped 2 workers", err
    # every worker is gone: none left in the session the run started
    left = subprocess.run(["pgrep", "-s", str(p.pid)], capture_output=True, text=True).stdout
    assert left.strip() == ""


def test_resume_with_another_steps_is_refused_unless_overridden(checkpoint_at_4, capsys,
                                                                 monkeypatch):
    """--steps 8 moves the cosine decay's end from 4 to 8: the LR would jump at iteration 4.
    Refused before any worker starts, naming both values; --override-opt-param-scheduler (or
    --decay-steps 4, the checkpoint's) lets it run."""
    import pipeexec.launching.launcher as launcher

    started = []
    monkeypatch.setattr(launcher, "launch", lambda *a, **k: started.append(a) or [None])
    capsys.readouterr()
    assert run_cli(["train", *TINY, "--steps", "8", "--load", str(checkpoint_at_4)]) == 2
    err = capsys.readouterr().err
    assert "decay_steps 4 in the checkpoint, 8 in this run (--steps 8" in err, err
    assert "Pass --decay-steps 4" in err and "--override-opt-param-scheduler" in err
    assert not started
    for extra in (["--override-opt-param-scheduler"], ["--decay-steps", "4"]):
        try:
            main(["train", *TINY, "--steps", "8", "--load", str(checkpoint_at_4), *extra])
        except SystemExit as exc:
            assert exc.code in (0, None), capsys.readouterr().err
        assert len(started) == 1, extra
        started.clear()


def test_fewer_microbatches_than_pp_is_warned_before_the_run(capsys, monkeypatch):
    import pipeexec.launching.launcher as launcher

    monkeypatch.setattr(launcher, "launch", lambda *a, **k: [None])
    try:
        main(["train", *TINY, "--layers", "3", "--pp", "3", "--microbatches", "1", "--steps", "1"])
    except SystemExit:
        pass
    err = capsys.readouterr().err
    assert "pipeexec: warning: --microbatches 1 with --pp 3: a pipeline of m = 1" in err
