"""The paper's learning-rate schedule (Section 4.1.1): linear warmup, then cosine decay.

Step s counts optimizer steps from 0:
    s <  W: lr = peak * (s + 1) / W            (the W-th step, s = W - 1, runs at the peak)
    s >= W: lr = final + (peak - final) * (1 + cos(pi * (s - W) / (S - 1 - W))) / 2
with W warmup steps (4,800 in the paper) and S total steps; the last step (s = S - 1) runs at
``final`` (1.28e-5 in the paper; peak 2e-4, or 3.2e-4 for the 4B models). Past S - 1 the
rate stays at ``final`` (a run resumed on an older, shorter schedule).
NOTE: no step runs at lr 0 (DeepSpeed's WarmupCosineLR runs its first two at 0).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


def paper_lr(step: int, *, peak: float, final: float, warmup_steps: int, total_steps: int) -> float:
    if total_steps <= warmup_steps:
        raise ValueError(
            f"total_steps={total_steps} must exceed warmup_steps={warmup_steps}: the schedule "
            f"needs at least one step after warmup"
        )
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    span = max(total_steps - 1 - warmup_steps, 1)
    progress = min((step - warmup_steps) / span, 1.0)
    return final + (peak - final) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """One run's learning-rate schedule, as every checkpoint records it (``record``). Called
    with a step, it is a ``LambdaLR`` factor: relative to ``lr``, which must be the optimizer's
    (``optim_state.use_schedule``)."""

    lr: float
    """The peak learning rate (--lr)."""
    min_lr: float
    """The rate of the last step (--min-lr)."""
    warmup_steps: int
    """Steps of linear warm-up, as in force: --lr-warmup-iters, at most total_steps - 1."""
    total_steps: int
    """The steps the cosine decays over (--train-iters, or --train-tokens in steps)."""

    def __post_init__(self):
        paper_lr(0, peak=self.lr, final=self.min_lr, warmup_steps=self.warmup_steps,
                 total_steps=self.total_steps)  # raises ValueError on a schedule without decay

    def lr_at(self, step: int) -> float:
        """The learning rate of step ``step`` (from 0)."""
        return paper_lr(step, peak=self.lr, final=self.min_lr, warmup_steps=self.warmup_steps,
                        total_steps=self.total_steps)

    def __call__(self, step: int) -> float:
        return self.lr_at(step) / self.lr

    def record(self) -> dict:
        return asdict(self)


def run_schedule(*, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> Schedule:
    """The schedule of a run of ``total_steps`` steps: warm-up is cut to ``total_steps - 1``
    steps where it would leave no step to decay over (a short run of a long-warm-up preset)."""
    return Schedule(lr=lr, min_lr=min_lr, warmup_steps=min(warmup_steps, total_steps - 1),
                    total_steps=total_steps)


def lr_lambda(*, peak: float, final: float, warmup_steps: int, total_steps: int) -> Schedule:
    """A ``LambdaLR`` factor (relative to ``peak``, the optimizer's lr) for ``paper_lr``."""
    return Schedule(lr=peak, min_lr=final, warmup_steps=warmup_steps, total_steps=total_steps)
