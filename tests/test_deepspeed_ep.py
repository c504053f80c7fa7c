"""DeepSpeed ZeRO-1/2 with megatron-core expert parallelism: EP=2 trains exactly like EP=1."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import run_distributed

STEPS, MICRO, GAS = 5, 2, 2
ARCHS = ("aoe", "moe")


def _train(rank, world_size, zero_stage, ep, out_dir):
    """Both architectures, one after the other, in one world (one launch per EP size)."""
    for arch in ARCHS:
        _train_arch(rank, world_size, arch, zero_stage, ep, out_dir)


def _train_arch(rank, world_size, arch, zero_stage, ep, out_dir):
    import torch.distributed as dist
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from aoe_megatron.moe import loss_tracker

    from aoe_megatron.models.gpt import build_gpt_model, load_preset, transformer_config
    from aoe_megatron.train.engine import build_engine

    cfg = load_preset("tiny", arch=arch, seq_length=32)
    torch.manual_seed(11)
    model = build_gpt_model(cfg, transformer_config(cfg, expert_parallel_size=ep))
    engine, _, _ = build_engine(model, zero_stage=zero_stage, lr=3e-3, micro_batch=MICRO,
                                grad_accum=GAS, ep_size=ep, num_experts=cfg.num_experts)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / GAS))
    position_ids = torch.arange(cfg.seq_length).unsqueeze(0).expand(MICRO, -1)
    losses = []
    for step in range(STEPS):
        step_loss = torch.zeros(())
        for micro in range(GAS):
            # The same batches every step: the loss must fall, and equally at both EP sizes.
            gen = torch.Generator().manual_seed(10 * micro + rank)
            tokens = torch.randint(0, cfg.vocab_size, (MICRO, cfg.seq_length + 1), generator=gen)
            loss = engine(tokens[:, :-1], position_ids, None, labels=tokens[:, 1:]).mean()
            engine.backward(loss)
            engine.step()
            loss_tracker.clear()
            step_loss += loss.detach() / GAS
        dist.all_reduce(step_loss)
        losses.append(step_loss.item() / world_size)
    if rank == 0:
        (out_dir / f"{arch}_z{zero_stage}_ep{ep}.json").write_text(json.dumps(losses))


@pytest.mark.legs
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("zero_stage", [1, 2])
def test_ep2_trains_like_ep1(tmp_path, zero_stage):
    for ep in (2, 1):
        run_distributed(_train, 2, zero_stage, ep, tmp_path, expert_parallel_size=ep)
    for arch in ARCHS:
        ep2 = json.loads((tmp_path / f"{arch}_z{zero_stage}_ep2.json").read_text())
        ep1 = json.loads((tmp_path / f"{arch}_z{zero_stage}_ep1.json").read_text())
        assert ep2 == pytest.approx(ep1, rel=1e-5, abs=1e-5), arch
        assert ep1[-1] < ep1[0], arch  # it does train


@pytest.mark.legs
def test_zero3_with_expert_parallelism_is_refused():
    from aoe_megatron.train.engine import check_zero_and_ep

    with pytest.raises(ValueError, match="ZeRO-3 with expert parallelism"):
        check_zero_and_ep(3, 2)
    check_zero_and_ep(3, 1)
    check_zero_and_ep(2, 2)
