"""The paper's losses and inits, exactly (issue #25): L_aux is Eq. 2 (Eq. 6 for AoE) at alpha_aux
whichever router computes it.

The reference is written from the paper, not from the code: in float64, f_i = (tokens whose top-K
holds expert i) / T, so the f_i sum to K; P_i = the mean over tokens of the softmax over all E
scores; L_aux = alpha * E * sum_i f_i P_i, f_i constant. The router's output gets zero gradient,
so what reaches its weights is L_aux's gradient alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from tests.helpers import build_aoe_layer, make_transformer_config

pytestmark = pytest.mark.legs  # L_aux is Eq. 2 for every router, on each release's tracker

ALPHA, E, K, D, T = 0.03, 4, 2, 16, 40


def eq2(scores_TE: torch.Tensor, alpha: float, top_k: int) -> torch.Tensor:
    """The paper's Eq. 2 from per-token scores (logits, or AoE's norms)."""
    num_tokens, num_experts = scores_TE.shape
    chosen_TE = torch.zeros_like(scores_TE).scatter(-1, scores_TE.topk(top_k, -1).indices, 1.0)
    f_E = chosen_TE.sum(0) / num_tokens  # sums to top_k
    p_E = torch.softmax(scores_TE, -1).mean(0)
    return alpha * num_experts * (f_E * p_E).sum()


def _router(kind: str):
    """(router, [its weights], scores(x_TD, *weights as float64) -> [T, E])."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from aoe_megatron.models.moe_router import RouterConfig, VariantRouter
    from aoe_megatron.models.stock_router import PaperTopKRouter

    tc = make_transformer_config(d_model=D, num_experts=E, top_k=K, alpha_aux=ALPHA)
    tc.moe_router_dtype = "fp32"
    if kind == "stock":
        router = PaperTopKRouter(config=tc, pg_collection=get_default_pg_collection())
        return router, [router.weight], lambda x, w: x @ w.t()
    if kind == "aoe":
        router = build_aoe_layer(tc, d_low=3, alpha_aux=ALPHA).router
        return router, [router.weight], lambda x, w: (x @ w).view(len(x), E, 3).norm(dim=-1)
    gate = {"linear": {}, "two_layer": {"gate": "two_layer", "hidden_per_expert": 3}}[kind]
    router = VariantRouter(config=tc, router=RouterConfig(num_experts=E, top_k=K, d_model=D,
                                                         alpha_aux=ALPHA, **gate))
    if kind == "linear":
        return router, [router.weight], lambda x, w: x @ w.t()
    return router, [router.w1, router.w2], lambda x, w1, w2: F.silu(x @ w1.t()) @ w2.t()


def _l_aux_grads(kind: str, padding_T=None):
    """The router's weights' gradients from L_aux alone, and Eq. 2's over the valid tokens."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    torch.manual_seed(0)
    router, weights, scores = _router(kind)
    router.train()
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    x_TD = torch.randn(T, D)
    mask = None if padding_T is None else padding_T.view(T, 1)
    out = router(x_TD.view(T, 1, D), mask)
    out[0].backward(torch.zeros_like(out[0]))  # only L_aux reaches the weights

    valid_TD = x_TD if padding_T is None else x_TD[~padding_T]
    ref = [w.detach().double().requires_grad_() for w in weights]
    want = torch.autograd.grad(eq2(scores(valid_TD.double(), *ref), ALPHA, K), ref)
    for w, g in zip(weights, want):
        assert w.grad is not None and w.grad.abs().sum() > 0
        assert_close(w.grad.double(), g, rtol=1e-4, atol=1e-9)
    return router, scores, weights, valid_TD


@pytest.mark.parametrize("kind", ["stock", "linear", "two_layer", "aoe"])
def test_l_aux_sends_the_router_the_gradient_of_eq2(megatron_world, kind):
    """The stock TopKRouter (Config 2, the 732M/4B baselines, the study's moe arm), the variant
    routers (Config 4's two-layer gate among them) and AoE's norms: the same Eq. 2 gradient.
    megatron-core's own switch loss divides f_i by K and would give half of it here."""
    _l_aux_grads(kind)


@pytest.mark.parametrize("kind", ["stock", "linear", "two_layer", "aoe"])
def test_padding_counts_in_neither_l_aux_nor_the_load(megatron_world, kind):
    """``padding_mask`` as megatron-core's GPTModel takes it (True = padding, excluded): every
    router's L_aux is Eq. 2 over the valid tokens only, and ours report their load over those."""
    padding_T = torch.zeros(T, dtype=torch.bool)
    padding_T[::3] = True
    router, scores, weights, valid_TD = _l_aux_grads(kind, padding_T)
    if kind != "stock":
        with torch.no_grad():
            s_TE = scores(valid_TD.double(), *(w.double() for w in weights))
        chosen_E = torch.zeros_like(s_TE).scatter(-1, s_TE.topk(K, -1).indices, 1.0).sum(0)
        assert_close(router.selection_stats.figures()[:E].double(), chosen_E / chosen_E.sum())


# --------------------------------------------------------------------------- inits


@pytest.mark.parametrize("factorized", ["gate", "up"])
def test_unfactorized_std_init_gives_the_factorized_projection_the_std_of_w_g(megatron_world,
                                                                               factorized):
    """x W_down W_up at init: with gate_init "unfactorized_std" the std of x W_g for W_g ~ N(0,
    0.02^2) (0.02 sqrt(d_model) for x ~ N(0, 1)); with the paper's default, sqrt(d_low) * 0.02
    times that."""
    d, r, n, tokens = 64, 16, 8, 512
    sigma = 0.02
    want = sigma * d ** 0.5
    got = {}
    for init in ("paper", "unfactorized_std"):
        torch.manual_seed(0)
        tc = make_transformer_config(d_model=d, d_ffn=128, num_experts=n, top_k=2)
        layer = build_aoe_layer(tc, d_low=r, d_wide=64, factorized=factorized, gate_init=init)
        assert tc.init_method_std == sigma
        x_TD = torch.randn(tokens, d, dtype=torch.float64)
        w_down = layer.router.weight.double().view(d, n, r)
        w_up = layer.experts.w_up.double()  # [n, r, W]
        product = torch.einsum("td,dnr,nrw->tnw", x_TD, w_down, w_up)
        got[init] = product.std().item()
    assert got["unfactorized_std"] == pytest.approx(want, rel=0.1)
    assert got["paper"] == pytest.approx(want * sigma * r ** 0.5, rel=0.1)


def test_gate_init_needs_a_factorized_projection():
    from aoe_megatron.moe.config import AoEConfig

    with pytest.raises(ValueError, match="gate_init applies to a factorized projection"):
        AoEConfig(d_low=4, factorized="none", gate_init="unfactorized_std")
    with pytest.raises(ValueError, match="unknown AoE gate_init"):
        AoEConfig(d_low=4, gate_init="xavier")


#: Every family of MoE block: AoE and its controls and variants, the stock router, the variant
#: routers (Config 4's two-layer gate, switch jitter, expert choice, hash).
BLOCKS = {
    "aoe": {"arch": "aoe"},
    "aoe_frozen_random": {"arch": "aoe", "aoe": {"rank_source": "frozen_random"}},
    "aoe_config3": {"arch": "aoe", "aoe": {"rank_source": "router"}},
    "aoe_imitation": {"arch": "aoe", "aoe": {"inference_selection": "router"}},
    "aoe_unfactorized_std": {"arch": "aoe", "aoe": {"gate_init": "unfactorized_std"}},
    "aoe_random": {"arch": "aoe", "alpha_aux": 0.0, "aoe": {"selection": "random"}},
    "moe": {"arch": "moe"},
    "moe_two_layer": {"arch": "moe", "router": {"gate": "two_layer", "hidden_per_expert": 4}},
    "moe_jitter": {"arch": "moe", "router": {"input_jitter": 0.01}},
    "moe_expert_choice": {"arch": "moe", "alpha_aux": 0.0, "router": {"selection": "expert_choice"}},
    "moe_random": {"arch": "moe", "alpha_aux": 0.0, "router": {"selection": "random"}},
    "moe_hash": {"arch": "moe", "alpha_aux": 0.0,
                 "router": {"gate": "hash", "selection": "hash"}},
}


def test_weights_two_architectures_share_start_identical_at_a_seed(megatron_world):
    """Embeddings, attention, norms and the output layer after every MoE block: the same at one
    seed whichever block the model has (each block's modules draw one seed apiece from the global
    RNG; megatron-core's router alone would draw E x D values)."""
    from aoe_megatron.models.gpt import build_gpt_model, load_preset, transformer_config

    shared = {}
    for name, changes in BLOCKS.items():
        cfg = load_preset("tiny", vocab_size=256, num_layers=3, **changes)
        torch.manual_seed(1234)
        model = build_gpt_model(cfg, transformer_config(cfg), use_te=False)
        shared[name] = {k: v.detach().clone() for k, v in model.state_dict().items()
                        if ".mlp." not in k and "_extra_state" not in k}
    reference = shared.pop("aoe")
    assert any("layers.2.self_attention" in k for k in reference)  # after two MoE blocks
    for name, weights in shared.items():
        assert weights.keys() == reference.keys(), name
        for key, value in weights.items():
            assert torch.equal(value, reference[key]), f"{name}: {key} differs from AoE's"
