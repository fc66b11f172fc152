"""`pipesim list` and `pipesim show`."""
import pipesim
from pipesim.cli import main


def test_list_names_every_schedule(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in pipesim.schedule_names():
        assert any(line.startswith(name + " ") for line in out.splitlines())
    assert max(len(line) for line in out.splitlines()) <= 100
    # every word of every constraint is there, wrapped or not
    words = " ".join(out.split())
    for name in pipesim.schedule_names():
        assert " ".join(pipesim.schedule_info(name).constraints.split()) in words
    assert main(["list", "--width", "60"]) == 0
    assert max(len(line) for line in capsys.readouterr().out.splitlines()) <= 60


def test_show_grid_places_actions_at_unit_steps(capsys):
    assert main(["show", "1f1b", "--pp", "2", "--microbatches", "2", "--width", "200"]) == 0
    lines = capsys.readouterr().out.splitlines()
    r0 = next(line for line in lines if line.startswith("rank 0")).split()[2:]
    r1 = next(line for line in lines if line.startswith("rank 1")).split()[2:]
    # 1F1B, pp=2, m=2 with unit costs: rank 1 starts one step late, rank 0 waits for 1B0.
    assert r0 == ["0F0", "0F1", ".", "0B0", ".", "0B1"]
    assert r1 == [".", "1F0", "1B0", "1F1", "1B1", "."]
    assert any("bubble rate 0.333" in line for line in lines)


def test_show_with_comms_and_exports(tmp_path, capsys):
    out_json, out_csv = tmp_path / "s.json", tmp_path / "s.csv"
    assert main(["show", "gpipe", "--pp", "2", "-m", "2", "--with-comms",
                 "--json", str(out_json), "--csv", str(out_csv)]) == 0
    out = capsys.readouterr().out
    assert "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1" in out
    assert pipesim.schedule_from_json(out_json) == pipesim.schedule_from_csv(out_csv)


def test_show_rejects_bad_parameters_with_reason(capsys):
    assert main(["show", "gpipe", "--vpp", "2"]) == 2
    assert "gpipe needs vpp == 1" in capsys.readouterr().err
    assert main(["show", "nope"]) == 2
    assert "unknown schedule 'nope'" in capsys.readouterr().err
