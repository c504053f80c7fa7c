"""Initialisation that does not depend on how experts are split over ranks.

Every AoE weight block belonging to global expert g is drawn from its own generator, seeded from
one number drawn from the global RNG when the module is built (identical on every rank, as
megatron-core already requires for replicated weights) and g. An expert therefore gets the same
initial weights at EP=1, 2 or 8, and two layers never share weights.

Every MoE block's module (AoE's router and experts, the stock router and experts, the variant
routers) draws exactly one seed from the global RNG, so the block consumes the same draws
whatever the architecture: at one seed, the weights two architectures share (embeddings,
attention, norms, the output layer) start identical (tests/test_paper_losses.py).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


def draw_module_seed() -> int:
    """One seed per module, drawn from the (rank-identical) global CPU RNG."""
    return int(torch.randint(0, 2**62, (1,), dtype=torch.int64).item())


def expert_normal_(
    out: torch.Tensor, *, module_seed: int, global_expert: int, slot: int, std: float
) -> torch.Tensor:
    """Fill ``out`` with N(0, std^2) from a generator owned by (module, expert, weight slot)."""
    gen = torch.Generator(device="cpu").manual_seed(
        (module_seed + 1_000_003 * global_expert + 7_919 * slot) % (2**63 - 1)
    )
    values = torch.empty(out.shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
    with torch.no_grad():
        out.copy_(values.to(out.dtype))
    return out


def target_device(config) -> torch.device:
    """Where parameters live: CUDA when present and not asked to initialise on the CPU."""
    if torch.cuda.is_available() and not config.use_cpu_initialization:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextmanager
def rng_untouched():
    """The CPU RNG (and this CUDA device's, if initialised) restored on exit: what runs inside
    consumes no draws of the global stream."""
    cuda = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda):
        yield
