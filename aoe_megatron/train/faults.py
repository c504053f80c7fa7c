"""Steps with a non-finite loss or gradient norm: stop the run (the default), or skip at most
``--skip-nonfinite N`` of them; and fault injection to test both.

DeepSpeed never applies a non-finite update in our configurations: ZeRO-1/2 (fp32 and bf16) and
ZeRO-3 find the global gradient norm invalid (inf, NaN), zero the gradients and skip both the
optimizer step and the lr scheduler's step (``stage_1_and_2.py`` / ``stage3.py`` ``step()``,
``engine._take_model_step``); bf16 also scans the gradients first (``bf16.check_grad_overflow``,
on by default). The engine tells through ``engine.was_step_applied()``, and this module does not
take DeepSpeed's word for granted: a non-finite step whose update *was* applied stops the run
whatever the limit, since the weights may be damaged.

A step (numbered from 1, as logged) is then
  - ok:       loss and gradient norm finite;
  - skipped:  non-finite, the update was not applied, and fewer than N steps were skipped before
              in the whole run (the count travels in the checkpoints' state.json). The weights
              stay those of the step before; the step's batch is not revisited, and the lr
              schedule lags one step behind the step count (as in Megatron-LM);
  - stopped:  otherwise. ``NonFiniteError`` names the step and the last good checkpoint, and the
              run saves nothing more: every checkpoint holds weights of finite steps only.

Fault injection (a testing aid in the spirit of Megatron-LM's error injection):
``--inject-nonfinite 3,5`` makes rank 0's loss NaN at steps 3 and 5, so its gradients, the
all-reduced loss and the global gradient norm are non-finite too. A resumed run that reaches an
injected step again meets the fault again, as with a persistent hardware or data fault.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional

from aoe_megatron.checkpoint.layout import latest_checkpoint
from aoe_megatron.train.values import parse_steps  # noqa: F401  (the faults' flag's parser)
from aoe_megatron.train.errors import TrainingHalted

__all__ = ["NonFiniteError", "NonFinitePolicy", "TrainingHalted", "clear_halt_record",
           "parse_steps", "write_halt_record"]

STATE_KEY = "nonfinite_skipped_steps"
"""state.json entry: the steps skipped so far in the run (their count is what N limits)."""


class NonFiniteError(TrainingHalted):
    """A non-finite step the policy does not skip."""


def is_finite(value) -> bool:
    """None (DeepSpeed computed no gradient norm) counts as finite: there is nothing to judge."""
    return value is None or math.isfinite(float(value))


@dataclass(frozen=True)
class Verdict:
    """What happens to a non-finite step; ``message`` is the log line (a sentence)."""

    step: int
    loss: float
    grad_norm: Optional[float]
    stopped: bool
    skipped: int
    """Steps skipped in the run so far, this one included when it was skipped."""
    limit: int
    message: str

    def raise_if_stopped(self) -> None:
        if self.stopped:
            raise NonFiniteError(self.message)


class NonFinitePolicy:
    """Judges each step after ``engine.step()``; holds the run's count of skipped steps."""

    def __init__(self, *, limit: int, inject: Iterable[int] = (), ckpt_dir=None):
        if limit < 0:
            raise ValueError(f"--skip-nonfinite must be >= 0, got {limit}")
        self.limit = limit
        self.inject_steps = frozenset(inject)
        self.ckpt_dir = ckpt_dir
        self.skipped_steps: list = []

    def restore(self, state: dict) -> None:
        """Continue the count of a resumed run from its checkpoint's state.json."""
        self.skipped_steps = [int(s) for s in state.get(STATE_KEY, [])]

    def state(self) -> dict:
        """Entries for the next checkpoint's state.json."""
        return {STATE_KEY: list(self.skipped_steps)}

    def inject(self, step: int, loss, rank: int):
        """``loss`` made NaN on rank 0 at an injected step (its gradients become NaN too)."""
        return loss * float("nan") if rank == 0 and step in self.inject_steps else loss

    def check(self, step: int, *, loss: float, grad_norm, applied: bool,
              nonfinite_ranks: int = 0) -> Optional[Verdict]:
        """None for a finite step; else the verdict (every rank reaches the same one: the loss,
        and ``nonfinite_ranks``, the count of ranks whose own loss was not finite, are agreed by
        one all-reduce, and the gradient norm and ``applied`` are global)."""
        grad_norm = None if grad_norm is None else float(grad_norm)
        if not nonfinite_ranks and is_finite(loss) and is_finite(grad_norm):
            return None
        what = f"step {step}: non-finite loss {loss:.4g} / grad norm " + (
            "n/a" if grad_norm is None else f"{grad_norm:.4g}")
        ranks = f"; the loss was not finite on {nonfinite_ranks} rank(s)" if nonfinite_ranks else ""
        flag = f"--skip-nonfinite {self.limit}"
        if applied:
            reason = ("the optimizer applied this step's update, so the weights may be damaged "
                      "(such a step is never skipped)")
        elif len(self.skipped_steps) < self.limit:
            self.skipped_steps.append(step)
            return Verdict(step, loss, grad_norm, False, len(self.skipped_steps), self.limit,
                           f"{what}; update skipped ({len(self.skipped_steps)} of at most "
                           f"{self.limit}, {flag}){ranks}")
        elif self.limit == 0:
            reason = flag
        else:
            reason = (f"step(s) {', '.join(map(str, self.skipped_steps))} were skipped already, "
                      f"the most {flag} allows")
        return Verdict(step, loss, grad_norm, True, len(self.skipped_steps), self.limit,
                       f"{what}; the run stops ({reason}){ranks}. {self._last_good()}")

    def _last_good(self) -> str:
        if not self.ckpt_dir:
            return "No checkpoint is written without --save (or --ckpt-dir)."

        try:
            latest = latest_checkpoint(self.ckpt_dir)
        except FileNotFoundError as err:
            return f"No good checkpoint to resume from: {err}."
        if latest is None:
            return f"No checkpoint was saved in {self.ckpt_dir} yet."
        return (f"Nothing was saved from this step; the last good checkpoint is {latest}: "
                f"restarting resumes from it (--skip-nonfinite N skips at most N such steps).")


HALTED = "halted.json"
CLEARED_HALT = "halted.json.cleared"
"""An earlier attempt's ``halted.json`` once a new attempt starts, until ``train/run_dir.py``
knows whether this attempt continues that run (then it is deleted) or starts a new one (then it
is moved aside with the earlier run's files)."""


def write_halt_record(run_dir, err: BaseException) -> None:
    """``halted.json`` beside ``finished.json``: a job script must not requeue such a run."""
    import json
    from pathlib import Path

    path = Path(run_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / HALTED).write_text(json.dumps(
        {"reason": type(err).__name__, "message": str(err)}, indent=2) + "\n")


def clear_halt_record(run_dir) -> None:
    """A new attempt starts: an earlier attempt's ``halted.json`` no longer holds (a job script
    that finds none requeues a crash of this attempt). It is kept as ``CLEARED_HALT``."""
    import os
    from pathlib import Path

    path = Path(run_dir) / HALTED
    if path.is_file():
        os.replace(path, path.with_name(CLEARED_HALT))
