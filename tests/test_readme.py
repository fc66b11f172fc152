"""The README's quick tour works as written: its Python block runs, its ``pipesim`` lines run
(in a scratch directory) and succeed, and every ``pipeexec`` line parses with the flags the
commands have (running them is the main job's and the multi-process tests' business)."""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def blocks(lang: str) -> list[str]:
    text = README.read_text()
    tour = text[text.index("## Quick tour"):text.index("## Schedules")]
    return re.findall(rf"```{lang}\n(.*?)```", tour, flags=re.S)


def commands(prefix: str) -> list[list[str]]:
    """The tour's command lines starting with ``prefix``, comments dropped, as argv lists."""
    out = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():   # continuation lines joined
            line = line.split("#", 1)[0].strip()
            if line.startswith(prefix + " ") and "..." not in line:
                out.append(shlex.split(line)[1:])
    return out


# The Hugging Face config.json the tour's lines read (a small Llama-family model).
HF_CONFIG = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816,
             "num_attention_heads": 16, "num_key_value_heads": 4, "num_hidden_layers": 8,
             "vocab_size": 32000, "max_position_embeddings": 2048}


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """A working directory holding the files the tour names."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    import pipesim      # the s.csv the Python tour writes
    pipesim.schedule_to_csv(pipesim.build_schedule("interleaved", pp=4, vpp=2, microbatches=8),
                            tmp_path / "s.csv")
    return tmp_path


def test_the_tour_has_lines_to_check():
    assert len(commands("pipesim")) >= 5 and len(commands("pipeexec")) >= 5
    assert len(blocks("python")) == 2


def test_python_tour_runs(scratch):
    for n, block in enumerate(blocks("python")):
        exec(compile(block, f"README quick tour, Python block {n + 1}", "exec"), {})
    assert (scratch / "interleaved.png").stat().st_size > 10_000
    assert (scratch / "interleaved.json").exists() and (scratch / "s.csv").exists()
    assert json.loads((scratch / "plan.json").read_text())["model"]["name"] == "llama3-70b"


def test_pipesim_lines_run_in_order(scratch, capsys):
    """In one directory, in the README's order, as a user types them (a later line may read a
    file an earlier one wrote, e.g. plan.json)."""
    from pipesim.cli import main

    for argv in commands("pipesim"):
        line = "pipesim " + " ".join(argv)
        if "--help" in argv:
            with pytest.raises(SystemExit) as info:
                main(argv)
            assert info.value.code == 0, line
        else:
            assert main(argv) == 0, f"{line}: {capsys.readouterr().err}"
        assert capsys.readouterr().out, line


@pytest.mark.parametrize("argv", commands("pipeexec"), ids=" ".join)
def test_pipeexec_lines_parse(argv):
    from pipeexec.cli.train import config_from_args, train_parser
    from pipeexec.cli.main import _parser
    from pipeexec.cli.compare import compare_parser

    if argv[0] == "compare":
        _, rest = compare_parser().parse_known_args(argv[1:])
        config_from_args(train_parser().parse_args(rest))
    elif argv[0] == "train":
        config_from_args(train_parser().parse_args(argv[1:])).validate()
    else:
        _parser().parse_args(argv)


def test_the_calibration_file_the_tour_names_is_what_the_main_job_writes():
    job = (README.parent / "scripts" / "main_job.sh").read_text()
    for argv in commands("pipeexec"):
        if "--calibrate-from" in argv:
            name = Path(argv[argv.index("--calibrate-from") + 1])
            assert name.parent == Path("out") and f'"$out/{name.name}"' in job


@pytest.mark.slow
def test_the_tours_calibrate_from_line_runs_as_written(tmp_path, monkeypatch, capsys):
    """The line is run exactly as the README spells it, against a calibration run written
    where the main job writes it: the model comes from the run's description."""
    from pipeexec.cli.main import main

    monkeypatch.chdir(tmp_path)
    tiny = ["--layers", "2", "--hidden", "16", "--heads", "2", "--seq-len", "8", "--vocab", "32",
            "--micro-batch-size", "2", "--no-progress"]
    main(["train", "--schedule", "1f1b", "--pp", "4", "--microbatches", "8", *tiny,
          "--steps", "3", "--profile", "1:3", "--trace-out", "out/run_1f1b.json"])
    (line,) = [argv for argv in commands("pipeexec") if "--calibrate-from" in argv]
    capsys.readouterr()
    with pytest.raises(SystemExit) as info:
        main(line)
    out = capsys.readouterr().out
    assert info.value.code == 0, out
    assert ("from the calibration run out/run_1f1b.json: hidden 16, heads 2, "
            "seq-len 8, vocab 32, micro-batch-size 2") in out
    assert "prediction before running" in out and "calibrated from a 1f1b run (pp=4" in out
