"""A run is validated once, before launch (`pipeexec.run.prepare`), and a rank assembled from
what that derived (`pipeexec.run.assemble_prepared`) neither validates the config again nor
builds the schedule again (a schedule file is read once); a launch value carries only its own
config's preparation."""
import pytest
import torch

import pipesim
from checkpoint_helpers import TINY, fake_topology
from pipeexec.config import TrainConfig
from pipeexec.parallel.mesh import Mesh
from pipeexec.run.assemble import assemble, assemble_prepared
from pipeexec.run.prepare import prepare
from pipeexec.run.worker import WorkerArgs
from pipeexec.topology import Topology


def test_a_prepared_run_is_assembled_without_validating_or_building_again(monkeypatch, tmp_path):
    path = tmp_path / "s.json"
    pipesim.schedule.io.schedule_to_json(pipesim.build_schedule("1f1b", pp=1, microbatches=2),
                                         str(path))
    cfg = TINY.with_flat(schedule=str(path))
    run = prepare(cfg, world_size=1)
    calls = []
    monkeypatch.setattr(TrainConfig, "validate", lambda self, *a, **k: calls.append("validate"))
    monkeypatch.setattr(TrainConfig, "build_schedule", lambda self: calls.append("build"))
    trainer = assemble_prepared(run, fake_topology())
    assert calls == [] and trainer.schedule is run.schedule
    assert trainer.step().loss > 0


def test_assemble_validates_once_and_refuses_another_topology(monkeypatch):
    count = []
    validate = TrainConfig.validate
    monkeypatch.setattr(TrainConfig, "validate",
                        lambda self, *a, **k: count.append(1) or validate(self, *a, **k))
    assemble(TINY, fake_topology())
    assert len(count) == 1
    tp2 = Topology.of(Mesh(tp=2), 0, device=torch.device("cpu"), backend="gloo")
    with pytest.raises(ValueError, match="but topology"):       # dp 2 on a tp 2 world
        assemble(TINY.with_flat(dp=2), tp2)


def test_worker_args_refuse_another_configs_preparation():
    run = prepare(TINY, world_size=1)
    assert WorkerArgs(TINY, prepared=run).prepared is run
    with pytest.raises(ValueError, match="another run's"):
        WorkerArgs(TINY.with_flat(lr=1e-4), prepared=run)
