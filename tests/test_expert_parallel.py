"""Expert parallelism on gloo: EP=2 and EP=4 equal EP=1, for both dispatchers and cache modes.

Every rank holds different tokens (as data-parallel ranks do). On each rank an EP=1 layer built
on singleton process groups, with the same initial weights, is the reference: outputs, L_aux and
input gradients must match per rank; weight gradients must match once summed over ranks (which is
what data-parallel reduction does).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close

from tests.helpers import (
    build_aoe_layer,
    make_transformer_config,
    read_aux,
    run_distributed,
    singleton_pg_collection,
)

D, R, W = 16, 6, 20
CASES = [(disp, mode) for disp in ("alltoall", "allgather") for mode in ("send", "recompute")]


def _forward_backward(layer, x, g):
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    (out * g).sum().backward()
    return out.detach(), read_aux(layer.router), x.grad


def _summed(t):
    t = t.clone()
    dist.all_reduce(t)
    return t


def _check_ep_equals_ep1(rank, world_size, num_experts, top_k, expert_backend="auto"):
    single = singleton_pg_collection(rank, world_size)
    for dispatcher, cache_mode in CASES:
        where = f"[rank {rank}, EP={world_size}, {dispatcher}, cache {cache_mode}, {expert_backend}]"
        layers = {}
        for ep, pgc in ((world_size, None), (1, single)):
            torch.manual_seed(7)  # same global RNG state -> same initial weights
            tc = make_transformer_config(d_model=D, num_experts=num_experts, top_k=top_k, ep=ep,
                                         dispatcher=dispatcher, alpha_aux=0.01)
            layers[ep] = build_aoe_layer(tc, pg_collection=pgc, d_low=R, d_wide=W,
                                         cache_mode=cache_mode, expert_backend=expert_backend)
        par, ref = layers[world_size], layers[1]
        local = par.experts.local_expert_indices
        assert len(local) == num_experts // world_size
        for name in ("w_up", "w_p", "w_o"):
            assert_close(getattr(par.experts, name), getattr(ref.experts, name)[local],
                         rtol=0, atol=0, msg=f"{where} initial {name} depends on EP")

        gen = torch.Generator().manual_seed(1000 + rank)
        x = torch.randn(6, 3, D, generator=gen)
        g = torch.randn(6, 3, D, generator=gen)
        out_p, aux_p, gx_p = _forward_backward(par, x, g)
        out_r, aux_r, gx_r = _forward_backward(ref, x, g)
        tol = dict(rtol=1e-5, atol=1e-6)
        assert_close(out_p, out_r, msg=f"{where} output", **tol)
        assert_close(aux_p, aux_r, msg=f"{where} L_aux", **tol)
        assert aux_r.item() > 0
        assert_close(gx_p, gx_r, msg=f"{where} input gradient", **tol)
        for name in ("w_up", "w_p", "w_o"):
            # An EP rank's experts see every rank's tokens: compare with the summed EP=1 grads.
            expected = _summed(getattr(ref.experts, name).grad)[local]
            assert_close(getattr(par.experts, name).grad, expected, msg=f"{where} grad {name}", **tol)
        assert_close(_summed(par.router.weight.grad), _summed(ref.router.weight.grad),
                     msg=f"{where} grad W_down (summed over ranks)", **tol)
        if cache_mode == "send":
            # The cache's gradient returns to the rank that computed it: per-rank equality.
            assert_close(par.router.weight.grad, ref.router.weight.grad,
                         msg=f"{where} grad W_down", **tol)


@pytest.mark.legs
@pytest.mark.distributed
def test_ep2_equals_ep1():
    run_distributed(_check_ep_equals_ep1, 2, 4, 2)


@pytest.mark.slow
@pytest.mark.distributed
def test_ep4_equals_ep1():
    run_distributed(_check_ep_equals_ep1, 4, 8, 2)


@pytest.mark.legs
@pytest.mark.slow
@pytest.mark.distributed
def test_ep2_equals_ep1_with_padded_and_autograd_experts():
    run_distributed(_check_ep_equals_ep1, 2, 4, 2, "padded")
    run_distributed(_check_ep_equals_ep1, 2, 4, 2, "autograd")
