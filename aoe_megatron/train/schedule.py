"""The paper's learning-rate schedule (Section 4.1.1): linear warmup, then cosine decay.

Step s counts optimizer steps from 0:
    s <  W: lr = peak * (s + 1) / W            (the W-th step, s = W - 1, runs at the peak)
    s >= W: lr = final + (peak - final) * (1 + cos(pi * (s - W) / (S - 1 - W))) / 2
with W warmup steps (4,800 in the paper) and S total steps; the last step (s = S - 1) runs at
``final`` (1.28e-5 in the paper; peak 2e-4, or 3.2e-4 for the 4B models).
NOTE: no step runs at lr 0 (DeepSpeed's WarmupCosineLR runs its first two at 0).
"""

from __future__ import annotations

import math


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


def lr_lambda(*, peak: float, final: float, warmup_steps: int, total_steps: int):
    """A ``LambdaLR`` factor (relative to ``peak``, the optimizer's lr) for ``paper_lr``."""
    paper_lr(0, peak=peak, final=final, warmup_steps=warmup_steps, total_steps=total_steps)
    return lambda step: paper_lr(step, peak=peak, final=final, warmup_steps=warmup_steps,
                                 total_steps=total_steps) / peak
