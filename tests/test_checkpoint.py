"""Expert weights survive a distributed checkpoint across expert-parallel sizes.

Saved weights are moved away from their initial values (by an amount that depends on the global
expert), so a load that silently kept fresh weights, or gave one rank another rank's experts,
fails.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from tests.helpers import (
    build_aoe_layer,
    make_transformer_config,
    run_distributed,
    singleton_pg_collection,
)

pytestmark = pytest.mark.legs  # checkpoints reshard across EP on each release

E, D, R, W = 4, 16, 6, 20
NAMES = ("w_up", "w_p", "w_o")


def _layer(ep, seed, pg_collection=None):
    torch.manual_seed(seed)
    tc = make_transformer_config(d_model=D, num_experts=E, top_k=2, ep=ep)
    return build_aoe_layer(tc, pg_collection=pg_collection, d_low=R, d_wide=W)


def _mark(layer):
    """Shift global expert g's weights by g + 1 and W_down by 0.25."""
    with torch.no_grad():
        for name in NAMES:
            param = getattr(layer.experts, name)
            for local, g in enumerate(layer.experts.local_expert_indices):
                param[local] += g + 1.0
        layer.router.weight += 0.25
    return layer


def _save(layer, path):
    from megatron.core import dist_checkpointing

    path.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(layer.sharded_state_dict(prefix="mlp."), str(path))


def _load(layer, path):
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(layer.sharded_state_dict(prefix="mlp."), str(path))
    layer.load_state_dict({k.removeprefix("mlp."): v for k, v in state.items()}, strict=True)


def _assert_same_experts(layer, expected):
    local = layer.experts.local_expert_indices
    for name in NAMES:
        assert_close(getattr(layer.experts, name), getattr(expected.experts, name)[local],
                     rtol=0, atol=0, msg=f"expert weights {name} of experts {local}")
    assert_close(layer.router.weight, expected.router.weight, rtol=0, atol=0, msg="W_down")


def _save_at_ep(rank, world_size, path):
    _save(_mark(_layer(world_size, seed=7)), path)


def _load_at_ep(rank, world_size, path):
    layer = _layer(world_size, seed=99)
    _load(layer, path)
    torch.manual_seed(0)
    expected = _mark(_layer(1, seed=7, pg_collection=None if world_size == 1 else _single(rank, world_size)))
    _assert_same_experts(layer, expected)


def _single(rank, world_size):
    return singleton_pg_collection(rank, world_size)


@pytest.mark.distributed
def test_save_ep2_load_ep1(megatron_world, tmp_path):
    run_distributed(_save_at_ep, 2, tmp_path / "ckpt")
    layer = _layer(1, seed=99)
    before = layer.experts.w_up.detach().clone()
    _load(layer, tmp_path / "ckpt")
    assert not torch.equal(before, layer.experts.w_up)
    _assert_same_experts(layer, _mark(_layer(1, seed=7)))


@pytest.mark.distributed
def test_save_ep1_load_ep2(megatron_world, tmp_path):
    _save(_mark(_layer(1, seed=7)), tmp_path / "ckpt")
    run_distributed(_load_at_ep, 2, tmp_path / "ckpt")


def _gpt_experts(model):
    """{(layer number, weight name, global expert): tensor} for this rank's AoE experts."""
    from aoe_megatron.moe.layer import AoEMoELayer

    out = {}
    for module in model.modules():
        if isinstance(module, AoEMoELayer):
            for name in NAMES:
                param = getattr(module.experts, name)
                for local, g in enumerate(module.experts.local_expert_indices):
                    out[(module.layer_number, name, g)] = param[local].detach().clone()
    return out


def _gpt_at_ep(ep, seed):
    from aoe_megatron.models.gpt import build_gpt_model, load_preset, transformer_config

    cfg = load_preset("tiny", arch="aoe")
    torch.manual_seed(seed)
    return build_gpt_model(cfg, transformer_config(cfg, expert_parallel_size=ep))


def _save_gpt_at_ep(rank, world_size, path):
    from megatron.core import dist_checkpointing

    model = _gpt_at_ep(world_size, seed=7)
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(path))
    dense = {n: p.detach().clone() for n, p in model.named_parameters() if "experts" not in n}
    torch.save({"experts": _gpt_experts(model), "dense": dense}, path.parent / f"expected{rank}.pt")


@pytest.mark.distributed
def test_gpt_model_saved_at_ep2_loads_at_ep1(megatron_world, tmp_path):
    from megatron.core import dist_checkpointing

    run_distributed(_save_gpt_at_ep, 2, tmp_path / "ckpt")
    model = _gpt_at_ep(1, seed=99)
    state = dist_checkpointing.load(model.sharded_state_dict(), str(tmp_path / "ckpt"))
    result = model.load_state_dict(state, strict=False)
    assert not [k for k in result.missing_keys if not k.endswith("_extra_state")], result
    assert not result.unexpected_keys, result
    loaded = _gpt_experts(model)
    expected = {}
    for rank in range(2):
        saved = torch.load(tmp_path / f"expected{rank}.pt")
        expected.update(saved["experts"])
        if rank == 0:
            dense = saved["dense"]
    assert set(loaded) == set(expected) and len(loaded) == 2 * 4 * len(NAMES)
    for key, value in expected.items():
        assert_close(loaded[key], value, rtol=0, atol=0, msg=f"expert weight {key}")
    params = dict(model.named_parameters())
    for name, value in dense.items():
        assert_close(params[name], value, rtol=0, atol=0, msg=name)
