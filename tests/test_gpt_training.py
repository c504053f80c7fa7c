"""A GPTModel with AoE layers (and the stock MoE baseline) learns a fixed batch on the CPU."""

from __future__ import annotations

import pytest
import torch

from aoe_megatron.models.gpt import load_preset

pytestmark = pytest.mark.legs  # the GPT models build and learn on each release


def train_fixed_batch(cfg, *, steps: int = 30, lr: float = 3e-3, batch_size: int = 4,
                      seed: int = 0) -> list[float]:
    """``cfg`` trained for ``steps`` plain AdamW steps on one fixed random batch (no DeepSpeed:
    the model alone); returns the LM losses. Needs megatron's parallel state."""
    from aoe_megatron.models.gpt import build_gpt_model
    from aoe_megatron.moe import loss_tracker

    torch.manual_seed(seed)
    model = build_gpt_model(cfg)
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_length + 1), generator=gen)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    position_ids = torch.arange(cfg.seq_length).unsqueeze(0).expand(batch_size, -1)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(inputs, position_ids, None, labels=labels).float().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_tracker.clear()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("arch", ["aoe", "moe"])
def test_loss_falls_in_30_steps(megatron_world, arch):
    cfg = load_preset("tiny", arch=arch)
    losses = train_fixed_batch(cfg, steps=30)
    assert all(torch.isfinite(torch.tensor(losses)))
    # Random tokens over 32,000 ids start near log(32000) = 10.4; memorising the batch drives it down.
    assert losses[0] > 9.5
    assert losses[-1] < 0.5 * losses[0], f"{arch} loss did not fall clearly: {losses}"


def test_gpt_model_has_aoe_layers_and_counts_match(megatron_world):
    from aoe_megatron.moe.layer import AoEMoELayer
    from aoe_megatron.models.gpt import build_gpt_model
    from aoe_megatron.models.params import count_parameters

    for arch in ("aoe", "moe"):
        cfg = load_preset("tiny", arch=arch)
        model = build_gpt_model(cfg)
        layers = [m for m in model.modules() if isinstance(m, AoEMoELayer)]
        assert len(layers) == (cfg.num_layers if arch == "aoe" else 0)
        allocated = sum(p.numel() for p in model.parameters())
        assert allocated == count_parameters(cfg).total, arch
