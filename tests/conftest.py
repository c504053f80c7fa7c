"""Shared fixtures: one gloo process group (world size 1) with megatron-core's parallel state."""

from __future__ import annotations

import os
import warnings

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")


@pytest.fixture(scope="session")
def megatron_world():
    """torch.distributed + megatron parallel state, TP = PP = EP = 1, in this process."""
    from aoe_megatron.runtime.distributed import init_megatron

    init_megatron(rank=0, world_size=1, expert_parallel_size=1)
    yield


@pytest.fixture
def seeded(megatron_world):
    import torch

    torch.manual_seed(0)
    yield
