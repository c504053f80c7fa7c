"""The AoE layer against Algorithm 2 written as a float64 per-token loop, forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from tests.helpers import build_aoe_layer, make_transformer_config, read_aux, reference_aoe

pytestmark = pytest.mark.legs  # the layer against Algorithm 2, on each CI leg

D, F_FFN, E, K, R, W = 16, 32, 4, 2, 6, 20


def _run_layer(layer, x_SBD, grad_SBD):
    x = x_SBD.clone().requires_grad_(True)
    out, bias = layer(x)
    assert bias is None
    loss = (out * grad_SBD).sum()
    loss.backward()
    aux = read_aux(layer.router)
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    return out.detach(), aux, x.grad, grads


def _run_reference(layer, x_SBD, grad_SBD, *, top_k, norm, selection, alpha_aux):
    params = {
        "w_down": layer.router.weight, "w_up": layer.experts.w_up,
        "w_p": layer.experts.w_p, "w_o": layer.experts.w_o,
    }
    ref = {n: p.detach().double().clone().requires_grad_(True) for n, p in params.items()}
    x = x_SBD.detach().double().clone().requires_grad_(True)
    out, aux = reference_aoe(
        x.reshape(-1, D), ref["w_down"], ref["w_up"], ref["w_p"], ref["w_o"], top_k=top_k,
        norm=norm, selection=selection, alpha_aux=alpha_aux,
    )
    ((out.reshape(x.shape) * grad_SBD.double()).sum() + aux).backward()
    return out.reshape(x.shape).detach(), torch.as_tensor(aux).detach(), x.grad, {
        "router.weight": ref["w_down"].grad, "experts.w_up": ref["w_up"].grad,
        "experts.w_p": ref["w_p"].grad, "experts.w_o": ref["w_o"].grad,
    }


CASES = [
    (norm, mode, alpha)
    for norm in ("l2", "l1", "linf")
    for mode in ("topk_softmax", "softmax_topk")
    for alpha in (0.0, 0.01)
]


@pytest.mark.parametrize("norm,selection,alpha_aux", CASES)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
def test_layer_matches_algorithm_2(seeded, norm, selection, alpha_aux, dtype, tol):
    tc = make_transformer_config(d_model=D, d_ffn=F_FFN, num_experts=E, top_k=K,
                                 alpha_aux=alpha_aux, dtype=dtype)
    layer = build_aoe_layer(tc, d_low=R, d_wide=W, norm=norm, selection=selection)
    x = torch.randn(5, 3, D, dtype=dtype)
    g = torch.randn(5, 3, D, dtype=dtype)
    out, aux, gx, grads = _run_layer(layer, x, g)
    r_out, r_aux, r_gx, r_grads = _run_reference(
        layer, x, g, top_k=K, norm=norm, selection=selection, alpha_aux=alpha_aux
    )
    kw = dict(rtol=tol, atol=tol)
    assert_close(out.double(), r_out, msg="layer output differs from Algorithm 2", **kw)
    assert_close(aux.double(), r_aux.double(), msg="L_aux differs from Eq. 6", **kw)
    assert_close(gx.double(), r_gx, msg="input gradient differs", **kw)
    for name, ref in r_grads.items():
        assert_close(grads[name].double(), ref, msg=f"gradient of {name} differs", **kw)
    if alpha_aux == 0:
        assert aux.item() == 0.0


@pytest.mark.parametrize("cache_mode", ["send", "recompute"])
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_dispatchers_and_cache_modes_match_reference(seeded, cache_mode, dispatcher):
    tc = make_transformer_config(d_model=D, d_ffn=F_FFN, num_experts=E, top_k=K,
                                 alpha_aux=0.01, dtype=torch.float64, dispatcher=dispatcher)
    layer = build_aoe_layer(tc, d_low=R, d_wide=W, cache_mode=cache_mode)
    x, g = torch.randn(4, 2, D, dtype=torch.float64), torch.randn(4, 2, D, dtype=torch.float64)
    out, aux, gx, grads = _run_layer(layer, x, g)
    r_out, r_aux, r_gx, r_grads = _run_reference(
        layer, x, g, top_k=K, norm="l2", selection="topk_softmax", alpha_aux=0.01
    )
    assert_close(out, r_out, rtol=1e-10, atol=1e-10)
    assert_close(aux, r_aux, rtol=1e-10, atol=1e-10)
    assert_close(gx, r_gx, rtol=1e-10, atol=1e-10)
    for name, ref in r_grads.items():
        assert_close(grads[name], ref, rtol=1e-10, atol=1e-10, msg=f"gradient of {name}")


def _experts_out(layer, x_TD, i):
    d_low = layer.aoe.d_low
    c = x_TD @ layer.router.weight[:, i * d_low : (i + 1) * d_low]
    e = layer.experts
    return (F.silu(c @ e.w_up[i]) * (x_TD @ e.w_p[i])) @ e.w_o[i]


def test_k_equals_e_is_softmax_weighted_sum_of_all_experts(seeded):
    tc = make_transformer_config(d_model=D, d_ffn=F_FFN, num_experts=E, top_k=E,
                                 dtype=torch.float64)
    layer = build_aoe_layer(tc, d_low=R, d_wide=W)
    x = torch.randn(7, 1, D, dtype=torch.float64)
    out, _ = layer(x)
    x_TD = x.reshape(-1, D)
    d_low = layer.aoe.d_low
    norms = torch.stack(
        [(x_TD @ layer.router.weight[:, i * d_low : (i + 1) * d_low]).norm(dim=-1)
         for i in range(E)], dim=-1)
    weights = torch.softmax(norms, dim=-1)
    expected = sum(weights[:, i : i + 1] * _experts_out(layer, x_TD, i) for i in range(E))
    assert_close(out.reshape(-1, D), expected, rtol=1e-10, atol=1e-10)


def test_one_expert_is_a_dense_ffn_with_factorized_gate(seeded):
    tc = make_transformer_config(d_model=D, d_ffn=F_FFN, num_experts=1, top_k=1,
                                 dtype=torch.float64)
    layer = build_aoe_layer(tc, d_low=R, d_wide=W)
    x = torch.randn(6, 2, D, dtype=torch.float64)
    out, _ = layer(x)
    w_gate = layer.router.weight @ layer.experts.w_up[0]  # W_g = W_down W_up
    dense = (F.silu(x @ w_gate) * (x @ layer.experts.w_p[0])) @ layer.experts.w_o[0]
    assert_close(out, dense, rtol=1e-10, atol=1e-10)


def test_selective_recompute_of_the_moe_layer_changes_nothing(seeded):
    runs = []
    for recompute in (False, True):
        torch.manual_seed(3)
        tc = make_transformer_config(d_model=D, d_ffn=F_FFN, num_experts=E, top_k=K,
                                     alpha_aux=0.01)
        if recompute:
            tc.recompute_granularity, tc.recompute_modules = "selective", ["moe"]
        layer = build_aoe_layer(tc, d_low=R, d_wide=W)
        assert layer.moe_layer_recompute == recompute
        gen = torch.Generator().manual_seed(4)
        x, g = torch.randn(4, 2, D, generator=gen), torch.randn(4, 2, D, generator=gen)
        runs.append(_run_layer(layer, x, g))
    (out0, aux0, gx0, grads0), (out1, aux1, gx1, grads1) = runs
    assert_close(out1, out0)
    assert_close(aux1, aux0)
    assert_close(gx1, gx0)
    for name in grads0:
        assert_close(grads1[name], grads0[name], msg=name)


def test_bf16_layer_tracks_float64_reference(seeded):
    tc = make_transformer_config(d_model=D, d_ffn=F_FFN, num_experts=E, top_k=K,
                                 dtype=torch.bfloat16)
    layer = build_aoe_layer(tc, d_low=R, d_wide=W)
    x = torch.randn(8, 2, D).to(torch.bfloat16)
    out, _ = layer(x)
    assert out.dtype == torch.bfloat16
    ref, _ = reference_aoe(
        x.reshape(-1, D).double(), layer.router.weight.double(), layer.experts.w_up.double(),
        layer.experts.w_p.double(), layer.experts.w_o.double(), top_k=K,
    )
    # Tokens whose top-2 norms are within bf16 rounding may pick other experts: compare the rest.
    err = (out.reshape(-1, D).double() - ref).abs().max(dim=-1).values
    scale = ref.abs().max()
    assert (err < 0.02 * scale).float().mean() >= 0.9, err / scale
