"""Expert weights survive a distributed checkpoint across expert-parallel sizes.

Saved weights are moved away from their initial values (by an amount that depends on the global
expert), so a load that silently kept fresh weights, or gave one rank another rank's experts,
fails.
"""

from __future__ import annotations

import torch
from torch.testing import assert_close

from tests.helpers import build_aoe_layer, make_transformer_config, run_distributed

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
    from tests.test_expert_parallel import _singleton_pg_collection

    return _singleton_pg_collection(rank, world_size)


def test_save_ep2_load_ep1(megatron_world, tmp_path):
    run_distributed(_save_at_ep, 2, tmp_path / "ckpt")
    layer = _layer(1, seed=99)
    before = layer.experts.w_up.detach().clone()
    _load(layer, tmp_path / "ckpt")
    assert not torch.equal(before, layer.experts.w_up)
    _assert_same_experts(layer, _mark(_layer(1, seed=7)))


def test_save_ep1_load_ep2(megatron_world, tmp_path):
    _save(_mark(_layer(1, seed=7)), tmp_path / "ckpt")
    run_distributed(_load_at_ep, 2, tmp_path / "ckpt")
