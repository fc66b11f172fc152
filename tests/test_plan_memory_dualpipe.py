"""The plan's memory prediction (`pipeexec.analysis.plan_memory`) for dualpipe, whose ranks hold
a model part and a copy of another: the plan's per-part bytes go onto every stage that
computes the part (2 pp stages over pp parts), as the executor holds them. Torch-free, no
process launched."""
from __future__ import annotations

import pytest

from pipeexec.analysis.plan_memory import predicted_activation_peaks, predicted_peaks
from pipeexec.analysis.tensor_parallel import as_executed
from pipeexec.config import TrainConfig
from pipesim.plan.footprint import BYTES_PER_PARAM


def dualpipe() -> TrainConfig:
    return TrainConfig.from_flat(schedule="dualpipe", pp=2, microbatches=4, layers=4)


def held_peaks(config: TrainConfig) -> list[float]:
    """Per rank, the largest sum of activations held, walking its computations in order: a
    (stage, microbatch) holds its part's bytes from its F to its B or W (the executor's I keeps
    them for W; only the head's I frees its logits, and no head stage runs I here)."""
    sched = config.build_schedule()
    part_bytes = as_executed(config.plan_as_run()).derive().costs.activation_bytes
    peaks = []
    for rank in range(sched.pp):
        held, peak = 0.0, 0.0
        for a in sched.compute_order(rank):
            assert not (a.op == "I" and sched.stage_part(a.stage) == sched.num_parts - 1)
            size = part_bytes[sched.stage_part(a.stage)]
            if a.op == "F":
                held += size
                peak = max(peak, held)
            elif a.op in ("B", "W"):
                held -= size
        peaks.append(peak)
    return peaks


def test_dualpipe_activation_peaks_are_the_held_activations_of_both_copies():
    config = dualpipe()
    sched = config.build_schedule()
    assert (sched.num_stages, sched.num_parts) == (4, 2)        # copies: more stages than parts
    predicted = predicted_activation_peaks(config)
    held = held_peaks(config)
    message = as_executed(config.plan_as_run()).derive().costs.p2p_bytes
    assert len(predicted) == 2 and min(held) > 0
    for rank, (p, h) in enumerate(zip(predicted, held)):
        # the held activations plus at most the two posted receive buffers (activation, gradient)
        assert h <= p <= h + 2 * message, (rank, p, h, message)
    # rank 1 runs rank 0's order mirrored, on the mirrored parts: the same peak
    assert predicted[0] == pytest.approx(predicted[1])


def test_dualpipe_peaks_add_both_parts_training_state_on_every_rank():
    """Each rank holds one part and a copy of the other, so the whole model's weights,
    gradients and AdamW state (fp32: Megatron's bytes per parameter) on top of its
    activations."""
    config = dualpipe()
    plan = as_executed(config.plan_as_run())
    params = sum(sum(part.values()) for part in plan.derive().stage_params)
    per_param = sum(BYTES_PER_PARAM[plan.parallelism.precision])
    state = [t - a for t, a in zip(predicted_peaks(config), predicted_activation_peaks(config))]
    assert state == pytest.approx([per_param * params] * 2)
