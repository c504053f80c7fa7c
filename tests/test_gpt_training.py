"""A GPTModel with AoE layers (and the stock MoE baseline) learns a fixed batch on the CPU."""

from __future__ import annotations

import pytest
import torch

from aoe_megatron.model import load_preset
from aoe_megatron.smoke import train_fixed_batch


@pytest.mark.parametrize("arch", ["aoe", "moe"])
def test_loss_falls_in_30_steps(megatron_world, arch):
    cfg = load_preset("tiny", arch=arch)
    losses = train_fixed_batch(cfg, steps=30, log=lambda _: None)
    assert all(torch.isfinite(torch.tensor(losses)))
    # Random tokens over 32,000 ids start near log(32000) = 10.4; memorising the batch drives it down.
    assert losses[0] > 9.5
    assert losses[-1] < 0.5 * losses[0], f"{arch} loss did not fall clearly: {losses}"


def test_gpt_model_has_aoe_layers_and_counts_match(megatron_world):
    from aoe_megatron.layer import AoEMoELayer
    from aoe_megatron.model import build_gpt_model
    from aoe_megatron.params import count_parameters

    for arch in ("aoe", "moe"):
        cfg = load_preset("tiny", arch=arch)
        model = build_gpt_model(cfg)
        layers = [m for m in model.modules() if isinstance(m, AoEMoELayer)]
        assert len(layers) == (cfg.num_layers if arch == "aoe" else 0)
        allocated = sum(p.numel() for p in model.parameters())
        assert allocated == count_parameters(cfg).total, arch
