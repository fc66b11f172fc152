"""Stopping a run that no longer trains, with one line naming the step, instead of going on.

Without a dynamic loss scale (fp32, bf16) a non-finite loss or gradient norm has no remedy: the
step would be skipped silently (weights untouched), and so would every later one, while the run
logs on and saves checkpoints as if it trained (Megatron-LM stops: its
``check_for_nan_in_loss_and_grad``). Under fp16 a skipped step is the loss scale's way to
find its level: the scale halves per overflow, so from the default 2**16 it reaches its floor
(``--min-loss-scale``, 1) in 16 skips; overflows that go on beyond that are inf or NaN that no
scale avoids (DeepSpeed stops at the minimum scale the same way). ``--max-skipped-steps``
bounds the consecutive skips; its default of 100 leaves the default scale 84 steps at its floor
for a transient spike to pass before the run is declared diverged.

Every rank holds the same all-reduced loss and norm, so every rank raises at the same step:
no rank waits on a peer that stopped. The check runs before the optimizer step, so the
diverged step neither updates the weights nor reaches the checkpoint callback.
"""
from __future__ import annotations

import math


class TrainingDiverged(RuntimeError):
    """The loss or the gradients are no longer finite numbers; ``step`` names where."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


class DivergenceGuard:
    """Per-step check of the all-reduced loss and squared gradient norm (`check`); counts the
    consecutive fp16 steps skipped for overflow."""

    def __init__(self, *, dynamic_scale: bool, precision: str, max_skipped_steps: int) -> None:
        self.dynamic_scale = dynamic_scale
        self.precision = precision
        self.max_skipped_steps = max_skipped_steps
        self.skipped_in_a_row = 0

    def check(self, step: int, loss: float, grad_sq: float, scale: float) -> None:
        """Raise `TrainingDiverged` when step ``step`` must not go on (``loss``: the mean loss
        of the global batch; ``grad_sq``: the squared norm of the scaled gradients)."""
        finite = math.isfinite(loss) and math.isfinite(grad_sq)
        if not self.dynamic_scale:
            if not finite:
                norm = math.sqrt(grad_sq) if math.isfinite(grad_sq) and grad_sq >= 0 else grad_sq
                raise TrainingDiverged(
                    f"step {step}: the loss is {loss:g} and the gradient norm {norm:g} in "
                    f"{self.precision}: training diverged (without fp16's loss scale a "
                    "non-finite step cannot be skipped); stopped before the optimizer step, so "
                    "no checkpoint holds it. Lower --lr, check the data, or resume from the last "
                    "checkpoint", step)
            return
        self.skipped_in_a_row = 0 if math.isfinite(grad_sq) else self.skipped_in_a_row + 1
        if self.skipped_in_a_row > self.max_skipped_steps:
            raise TrainingDiverged(
                f"step {step}: {self.skipped_in_a_row} consecutive fp16 steps overflowed (inf or "
                f"NaN gradients; loss scale {scale:g}), more than --max-skipped-steps "
                f"{self.max_skipped_steps}: the run no longer trains. Lower --lr, check the "
                "data, or resume from the last checkpoint", step)
