"""Values that would pass a loose check and then fail (or mean nothing) inside the workers are
refused before any process starts, naming the flag and what is accepted: timeouts that are
nan or infinite, a ``--timeout`` not above zero, memory sizes in bits, below a byte, infinite or
below one microbatch, ``--data`` naming a directory, and a checkpoint of another model."""
from __future__ import annotations

import pytest

from pipeexec.cli.main import main

TINY = ["--layers", "1", "--hidden", "16", "--heads", "2", "--seq-len", "8", "--vocab", "256",
        "--no-progress"]


@pytest.fixture
def no_launch(monkeypatch):
    import pipeexec.launching.launcher as launcher

    monkeypatch.setattr(launcher, "launch", lambda *a, **k: pytest.fail("a worker started"))


def refused(argv, capsys) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(["train", *TINY, *argv])
    assert info.value.code == 2, capsys.readouterr()
    return capsys.readouterr().err


ZB_AUTO = ["--schedule", "zb-auto", "--pp", "2", "--layers", "2", "--microbatches", "2",
           "--steps", "6"]


@pytest.mark.parametrize("argv,says", [
    (["--p2p-timeout", "nan"], "p2p_timeout (--p2p-timeout) must be a finite number of seconds "
                               "> 0, got nan"),
    (["--collective-timeout", "inf"], "collective_timeout (--collective-timeout) must be a "
                                      "finite number of seconds > 0, got inf"),
    (["--p2p-timeout", "0"], "p2p_timeout (--p2p-timeout) must be a finite number"),
    (["--timeout", "-1"], "--timeout must be a finite number of seconds > 0"),
    (["--timeout", "nan"], "--timeout must be a finite number of seconds > 0"),
    (["--timeout", "inf"], "--timeout must be a finite number of seconds > 0"),
    ([*ZB_AUTO, "--memory-limit", "1e-9B"], "'1e-9B': less than one byte"),
    ([*ZB_AUTO, "--memory-limit", "1e400GB"], "'1e400GB': must be finite"),
    ([*ZB_AUTO, "--memory-limit", "10Gb"], "'Gb' is bits; write 10GB for bytes"),
    ([*ZB_AUTO, "--memory-limit", "100B"], "memory_limit (--memory-limit) 100 bytes is below "
                                           "what one microbatch needs on a rank (at least 512 "
                                           "bytes"),
])
def test_refused_before_any_worker_naming_the_flag(argv, says, capsys, no_launch):
    err = refused(argv, capsys)
    assert says in err, err


def test_data_naming_a_directory_says_so(tmp_path, capsys, no_launch):
    err = refused(["--data", str(tmp_path)], capsys)
    assert f"data: {str(tmp_path)!r} is a directory; --data takes 'synthetic' or a text " \
           "file" in err, err


def test_a_checkpoint_of_another_model_is_refused_before_launch(tmp_path, capsys, monkeypatch):
    ck = tmp_path / "ck"
    main(["train", *TINY, "--steps", "1", "--save", str(ck)])
    import pipeexec.launching.launcher as launcher

    monkeypatch.setattr(launcher, "launch", lambda *a, **k: pytest.fail("a worker started"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(["train", *TINY, "--hidden", "32", "--steps", "2", "--load", str(ck)])
    err = capsys.readouterr().err
    assert info.value.code == 1, err
    assert "config mismatch" in err and "hidden: the checkpoint was written with hidden=16, " \
           "this run has hidden=32" in err, err
