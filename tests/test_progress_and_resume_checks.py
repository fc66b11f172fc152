"""A progress bar draws only on a terminal; the checks before a run warns of a pipeline with
fewer microbatches than stages and refuses a resume that would reshape the LR schedule."""
from __future__ import annotations

import io

import pytest

from pipesim.progress import progress_bar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_progress_bar_is_off_unless_it_writes_to_a_terminal():
    piped = io.StringIO()
    bar = progress_bar(total=3, file=piped)
    assert bar.disable
    bar.update(3)
    bar.close()
    assert piped.getvalue() == ""
    tty = _Terminal()
    bar = progress_bar(total=3, file=tty)
    assert not bar.disable
    bar.update(3)
    bar.close()
    assert "3/3" in tty.getvalue()
    assert progress_bar(total=3, file=_Terminal(), disable=True).disable   # --no-progress wins


def test_fewer_microbatches_than_stages_is_warned_of():
    from pipeexec.run.preflight import microbatch_warning

    w = microbatch_warning(3, 1)
    assert w.startswith("--microbatches 1 with --pp 3: a pipeline of m = 1") and "67%" in w
    assert "pass --microbatches 3 or more" in w
    assert microbatch_warning(3, 3) is None and microbatch_warning(1, 1) is None


RECORD = {"num_updates": 10, "max_lr": 3e-4, "min_lr": 0.0, "warmup_steps": 0, "decay_steps": 20}


def _config(**kw):
    from pipeexec.config import TrainConfig

    return TrainConfig.from_flat(**{"lr": 3e-4, "min_lr": 0.0, "warmup_steps": 0, "steps": 20,
                                    **kw})


def test_a_resume_that_would_reshape_the_lr_schedule_is_refused_naming_both():
    from pipeexec.config import ConfigError
    from pipeexec.run.preflight import check_lr_schedule

    check_lr_schedule(_config(), RECORD, "ckpt")                       # the same schedule
    check_lr_schedule(_config(steps=50, decay_steps=20), RECORD, "ckpt")  # decay kept: fine
    with pytest.raises(ConfigError) as info:
        check_lr_schedule(_config(steps=50), RECORD, "ckpt")
    msg = str(info.value)
    assert msg.startswith("--load ckpt: the checkpoint's learning-rate schedule differs")
    assert "decay_steps 20 in the checkpoint, 50 in this run (--steps 50" in msg
    assert "Pass --decay-steps 20 to keep the checkpoint's schedule" in msg
    assert "--override-opt-param-scheduler" in msg
    with pytest.raises(ConfigError, match="max_lr 0.0003 in the checkpoint, 0.001 in this run "
                                          r"\(--lr 0.001\)"):
        check_lr_schedule(_config(lr=1e-3), RECORD, "ckpt")
    check_lr_schedule(_config(steps=50), None, "ckpt")                 # an old checkpoint


def test_the_override_flag_exists_and_needs_load():
    from pipeexec.checkpoint import CheckpointOptions

    assert CheckpointOptions(load="d", override_opt_param_scheduler=True).validate()
    with pytest.raises(ValueError, match="--override-opt-param-scheduler needs --load"):
        CheckpointOptions(override_opt_param_scheduler=True).validate()


def test_a_plan_priced_with_the_cp_ring_is_run_with_a_note():
    """pipeexec all-gathers K/V: a plan priced with pipesim's ring (cp_comm p2p) runs, saying so."""
    from dataclasses import replace

    from pipeexec.run.preflight import cp_comm_warning
    from pipesim.plan.parallelism import Parallelism

    ring = Parallelism(tp=1, pp=2, dp=1, cp=2, micro_batch_size=1, global_batch_size=4)
    assert "pipeexec all-gathers K/V" in cp_comm_warning(ring)
    assert "--cp-comm all_gather" in cp_comm_warning(ring)
    assert cp_comm_warning(replace(ring, cp_comm="all_gather")) is None
    assert cp_comm_warning(replace(ring, cp=1)) is None
