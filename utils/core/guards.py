"""Guards the three train scripts share: no optimizer step from a NaN or infinite loss or gradient, and no run that
goes on learning nothing.

`StepGuard.step_ok` is called once per optimizer step on every process, after the backward (and clipping) and
before `optimizer.step()`: when the step's loss or its gradient norm is not finite on any process, every process
skips that step together (no optimizer or scheduler step; the script zeroes the gradients as always) and the count
goes to the logs as `skipped_steps`; `--max_skipped_steps` skipped in a row stop the run with an error naming the
step, its last checkpoint intact (`save_checkpoint` never writes non-finite weights either). As verl does, a step
is skipped rather than the run stopped at once: one bad batch in a week of training should not end it.

Under DeepSpeed the engine takes its step inside `accelerator.backward`, and skips it itself when the gradient
norm is not finite (ZeRO's overflow check); the guard reads that outcome (`optimizer.step_was_skipped`), so the count
and the stop are the same, but a non-finite loss whose gradients are finite was already stepped on.

`UnscoredStreak` stops a run whose reward has scored nothing for `--max_unscored_steps` steps in a row (a judge
that answers with no verdict, a reward server that returns nothing): Mix-GRPO counts per stage.
"""

from __future__ import annotations

import math

import torch


class RunStopped(SystemExit, RuntimeError):
    """A guard stopped the run. A SystemExit, so a script ends with the message and no traceback (exit status 1),
    on every process together; a RuntimeError for library callers."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class NonFiniteStepsError(RunStopped):
    """Too many optimizer steps in a row had a NaN or infinite loss or gradient norm."""


class UnscoredError(RunStopped):
    """The reward scored nothing for too many steps in a row."""


def _all_finite(loss, grad_norm, parameters) -> bool:
    if loss is not None and not bool(torch.isfinite(torch.as_tensor(loss, dtype=torch.float32)).all()):
        return False
    if grad_norm is not None:
        return math.isfinite(float(grad_norm))
    return all(p.grad is None or bool(p.grad.isfinite().all()) for p in parameters or [])


class StepGuard:
    """See the module docstring. `state_dict` goes into the checkpoint, so a resumed run counts on."""

    def __init__(self, accelerator, max_skipped_steps: int = 3):
        self.accelerator, self.max_skipped_steps = accelerator, max_skipped_steps
        self.skipped_steps = 0  # in the whole run
        self.in_a_row = 0

    def step_ok(self, step: int, loss, grad_norm=None, parameters=None, optimizer=None) -> bool:
        """True: take optimizer step `step` (1-based). False: skip it, on every process. `loss`: the step's loss
        (this process's); `grad_norm`: its gradient norm before clipping, or None to check `parameters`' gradients.
        Raises NonFiniteStepsError on the --max_skipped_steps'th skip in a row."""
        finite = _all_finite(loss, grad_norm, parameters)
        if optimizer is not None and self.accelerator.distributed_type.name == "DEEPSPEED":
            finite = finite and not optimizer.step_was_skipped  # DeepSpeed stepped (or not) inside backward
        flag = torch.tensor(0.0 if finite else 1.0, device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            flag = self.accelerator.reduce(flag, "max")
        if flag.item() == 0.0:
            self.in_a_row = 0
            return True
        self.skipped_steps += 1
        self.in_a_row += 1
        self.accelerator.print(f"step {step}: the loss or the gradient norm is not finite (NaN or inf): optimizer "
                               f"step skipped ({self.in_a_row} in a row, {self.skipped_steps} in the run)")
        if self.in_a_row >= self.max_skipped_steps:
            raise NonFiniteStepsError(
                f"step {step}: {self.in_a_row} optimizer steps in a row had a NaN or infinite loss or gradient norm "
                f"(--max_skipped_steps {self.max_skipped_steps}), stopping; the weights are those before them and the "
                "last checkpoint is intact. Look at the rewards and the learning rate of the steps before")
        return False

    def state_dict(self) -> dict:
        return {"skipped_steps": self.skipped_steps, "in_a_row": self.in_a_row}

    def load_state_dict(self, state: dict | None):
        state = state or {}
        self.skipped_steps, self.in_a_row = state.get("skipped_steps", 0), state.get("in_a_row", 0)


class UnscoredStreak:
    """Counts, per stage, the steps in a row whose reward was asked to score images and scored none."""

    def __init__(self, reward: str, max_unscored_steps: int):
        self.reward, self.max_unscored_steps = reward, max_unscored_steps
        self.in_a_row: dict[str, int] = {}

    def update(self, stage: str, step: int, asked: int, scored: int):
        """After a step of `stage`: `asked` images went to the reward (all processes), `scored` got a score. Raises
        UnscoredError on the --max_unscored_steps'th step in a row with none scored."""
        if asked == 0:
            return
        self.in_a_row[stage] = 0 if scored else self.in_a_row.get(stage, 0) + 1
        if self.in_a_row[stage] >= self.max_unscored_steps:
            raise UnscoredError(
                f"step {step}: reward {self.reward!r} scored none of the {stage} stage's images for "
                f"{self.in_a_row[stage]} of its steps in a row (--max_unscored_steps {self.max_unscored_steps}): "
                "training on nothing, stopping. Check the reward server or judge (its replies, its logs)")

    def state_dict(self) -> dict:
        return dict(self.in_a_row)

    def load_state_dict(self, state: dict | None):
        self.in_a_row = dict(state or {})
