"""The paper's learning-rate schedule (Section 4.1.1) at its defining steps, through LambdaLR."""

from __future__ import annotations

import math

import pytest
import torch

from aoe_megatron.train.schedule import lr_lambda, paper_lr

PEAK, FINAL, WARMUP, TOTAL = 2e-4, 1.28e-5, 4800, 23842  # 100B tokens / 4.2M-token batches


def _lrs_through_lambdalr(steps):
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([param], lr=PEAK)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lr_lambda(peak=PEAK, final=FINAL, warmup_steps=WARMUP, total_steps=TOTAL))
    seen = {}
    for step in range(max(steps) + 1):
        if step in steps:
            seen[step] = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
    return seen


def test_paper_schedule_at_its_defining_steps():
    last = TOTAL - 1
    seen = _lrs_through_lambdalr({0, 1, 4799, 4800, 4801, last})
    assert seen[0] == pytest.approx(PEAK / WARMUP)  # linear warmup: no step at lr 0
    assert seen[1] == pytest.approx(2 * PEAK / WARMUP)
    assert seen[4799] == pytest.approx(PEAK)  # the 4,800th step reaches the peak
    assert seen[4800] == pytest.approx(PEAK)  # cosine starts at the peak
    expected_4801 = FINAL + (PEAK - FINAL) * 0.5 * (1 + math.cos(math.pi / (TOTAL - 1 - WARMUP)))
    assert seen[4801] == pytest.approx(expected_4801, rel=1e-9)
    assert seen[4801] < PEAK
    assert seen[last] == pytest.approx(FINAL)


def test_schedule_is_monotone_and_validated():
    lrs = [paper_lr(s, peak=3.2e-4, final=1.28e-5, warmup_steps=10, total_steps=50) for s in range(50)]
    assert all(a < b for a, b in zip(lrs[:9], lrs[1:10]))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs[-1] == pytest.approx(1.28e-5)
    with pytest.raises(ValueError, match="must exceed warmup_steps"):
        paper_lr(0, peak=1.0, final=0.1, warmup_steps=10, total_steps=10)
