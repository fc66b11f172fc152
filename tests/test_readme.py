"""The README's quick tour works as written: its Python block runs, its ``pipesim`` lines run
(in a scratch directory) and succeed, and every ``pipeexec`` line parses with the flags the
commands have (running them is the main job's and the multi-process tests' business)."""
from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def blocks(lang: str) -> list[str]:
    text = README.read_text()
    tour = text[text.index("## Quick tour"):text.index("## Schedules")]
    return re.findall(rf"```{lang}\n(.*?)```", tour, flags=re.S)


def lines() -> list[str]:
    """The tour's bash lines, continuation lines joined and comments dropped, in order."""
    out = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():   # continuation lines joined
            line = line.split(" #", 1)[0].strip() if not line.lstrip().startswith("#") else ""
            if line:
                out.append(line)
    return out


def commands(prefix: str) -> list[list[str]]:
    """The tour's command lines starting with ``prefix``, as argv lists."""
    return [shlex.split(line)[1:] for line in lines()
            if line.startswith(prefix + " ") and "..." not in line]


SHELL = ("echo ", "mkdir ")      # the tour's lines that make files with the shell


def run_shell_lines(where: Path) -> None:
    for line in lines():
        if line.startswith(SHELL):
            subprocess.run(["bash", "-c", line], cwd=where, check=True)


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """A working directory holding the files the tour's shell lines make (its config.json)."""
    monkeypatch.chdir(tmp_path)
    run_shell_lines(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"
    import pipesim      # the s.csv the Python tour writes
    pipesim.schedule_to_csv(pipesim.build_schedule("interleaved", pp=4, vpp=2, microbatches=8),
                            tmp_path / "s.csv")
    # the hardware file the tour's `pipeexec calibrate-hardware --out cpu.json` measures (its
    # pipeexec lines are parsed, not run): a preset's, in the same format
    from pipesim.hardware import get_hardware
    (tmp_path / "cpu.json").write_text(json.dumps(get_hardware("A100").to_dict()))
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


def test_every_file_the_tour_reads_is_made_by_an_earlier_line():
    """A new user starts in an empty directory: each file a line reads (a config.json, a
    schedule file, a plan, a checkpoint) is written by a line above it."""
    text = README.read_text()
    tour = text[text.index("## Quick tour"):text.index("## Schedules")]
    made: set[str] = set()
    reads = {"--model": ".json", "--schedule": (".json", ".csv"), "--plan": "", "--load": "",
             "--calibrate-from": ""}
    writes = ("--json", "--save", "--save-plan", "--plan-out", "--out", "--report-out", "--csv")
    checked = 0
    for lang, body in re.findall(r"```(python|bash)\n(.*?)```", tour, flags=re.S):
        if lang == "python":
            made.update(re.findall(r"""(?:savefig|to_chrome_trace|schedule_to_csv\(s,|save)\(?\s*"([^"]+)\"""",
                                   body))
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if not line or line.startswith("#") or "..." in line:
                continue
            words = shlex.split(line)
            if ">" in words:
                made.add(words[words.index(">") + 1])
            for i, w in enumerate(words[:-1]):
                nxt = words[i + 1]
                suffix = reads.get(w)
                if suffix is not None and nxt.endswith(suffix or "") and (
                        w != "--model" or nxt.endswith(".json")) and not nxt.startswith("out/"):
                    assert nxt in made, f"{line!r} reads {nxt}, which no earlier line makes"
                    checked += 1
                if words[:3] == ["pipeexec", "checkpoint", "inspect"] and i == 2:
                    assert nxt in made, f"{line!r} reads {nxt}, which no earlier line makes"
                    checked += 1
            if words[:2] == ["pipesim", "simulate"] and words[2].endswith((".csv", ".json")):
                assert words[2] in made, f"{line!r} reads {words[2]}"
                checked += 1
            made.update(words[i + 1] for i, w in enumerate(words[:-1]) if w in writes)
    assert checked >= 6 and {"config.json", "my_schedule.json", "ckpt"} <= made


@pytest.mark.parametrize("argv", commands("pipeexec"), ids=" ".join)
def test_pipeexec_lines_parse(argv, scratch):
    from pipeexec.cli.train import config_from_args, train_parser
    from pipeexec.cli.main import _parser
    from pipeexec.cli.compare import compare_parser
    from pipesim.cli import main as pipesim_main

    for name in [a for a in argv if a.endswith(".json") and not Path(a).exists()]:
        for line in commands("pipesim"):              # the tour line that writes it
            if name in line and ("--json" in line or "--plan-out" in line):
                assert pipesim_main(line) == 0

    if "--data-path" in argv:                     # the user's corpus and tokenizer, made here,
        make_training_data(scratch)               # then the tour's preprocess-data line run
    if argv[0] == "compare":
        _, rest = compare_parser().parse_known_args(argv[1:])
        config_from_args(train_parser().parse_args(rest))
    elif argv[0] == "train":
        config_from_args(train_parser().parse_args(argv[1:])).validate()
    else:
        _parser().parse_args(argv)


def make_training_data(where: Path) -> None:
    """What the tour's training path starts from: ``corpus.jsonl`` and the tokenizer folder it
    names (tests/data_helpers.py: a tiny corpus and a byte-level BPE trained on it), then the
    tour's own ``pipeexec preprocess-data`` line, as written."""
    from data_helpers import make_corpus, make_tokenizer
    from pipeexec.cli.main import main

    (line,) = [argv for argv in commands("pipeexec") if argv[0] == "preprocess-data"]
    args = dict(zip(line[1::2], line[2::2]))
    corpus = make_corpus(where, name=args["--input"])
    make_tokenizer(where / args["--tokenizer"], corpus, 300)
    try:
        status = main(line)
    except SystemExit as exc:
        status = exc.code
    assert not status and (where / (args["--output-prefix"] + ".idx")).is_file()


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


# -- the README and docs/ as pages of a clone ------------------------------------------------

DOCS = sorted((README.parent / "docs").glob("*.md"))


def _prose(page: Path) -> str:
    """The page without its code blocks and inline code (which hold commands, not links)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub makes of a page's headings (lower case, punctuation dropped, spaces
    to hyphens, a repeated heading numbered)."""
    seen: dict[str, int] = {}
    out = set()
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_every_relative_link_names_a_file_of_the_clone():
    """Every relative link and image in README.md and docs/*.md points to a file in this
    repository (none outside it, as ../shared/ would be), and its #anchor to a heading there."""
    root = README.parent.resolve()
    checked = 0
    for page in [README, *DOCS]:
        for target in re.findall(r"\]\(([^)\s]+)\)", _prose(page)):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):          # https:, mailto:
                continue
            name, _, anchor = target.partition("#")
            path = (page.parent / name).resolve() if name else page.resolve()
            where = f"{page.relative_to(root)}: {target}"
            assert path.is_relative_to(root), f"{where} leaves the repository"
            assert path.exists(), f"{where} names no file"
            if anchor and path.suffix == ".md":
                assert anchor in _anchors(path), f"{where}: no such heading"
            checked += 1
    assert checked >= 20


def test_the_pages_speak_to_users():
    """No internal issue numbers, no links into ../shared/."""
    for page in [README, *DOCS]:
        text = page.read_text()
        assert not re.search(r"\bissues?\s*#?\d+|(?<![\w&/#])#\d+\b", text, flags=re.I), page.name
        assert "shared/" not in "".join(re.findall(r"\]\(([^)\s]+)\)", text)), page.name
