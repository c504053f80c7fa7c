"""The paper's ablations and the review's controls: each strategy's defining property, and every
ablation preset (shrunk to CPU size, variant settings kept) trains a step at EP=1 and EP=2."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from aoe_megatron.moe import ops
from aoe_megatron.moe.selection import expert_capacity, select_experts
from tests.helpers import build_aoe_layer, make_transformer_config, run_distributed

ABLATIONS = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "run" / "presets" / "ablations").glob("*.yaml"))


def test_top_p_selects_the_smallest_set_reaching_p():
    torch.manual_seed(0)
    norms = torch.randn(300, 8, dtype=torch.float64) * 2
    sel = select_experts(norms, strategy="top_p", top_k=2, p=0.6)
    probs = torch.softmax(norms, dim=-1)
    for t in range(norms.shape[0]):  # reference: add experts by probability until the mass reaches p
        order = sorted(range(8), key=lambda e: -probs[t, e].item())
        chosen, mass = [], 0.0
        for e in order:
            chosen.append(e)
            mass += probs[t, e].item()
            if mass >= 0.6:
                break
        assert set(torch.nonzero(sel.routing_map_TE[t]).flatten().tolist()) == set(chosen)
        assert_close(sel.probs_TE[t], probs[t] * sel.routing_map_TE[t], rtol=1e-5, atol=1e-8)
    sizes = sel.routing_map_TE.sum(-1)
    assert sizes.min() >= 1 and sizes.max() > sizes.min()  # a varying number of experts


def test_expert_choice_gives_every_expert_exactly_its_capacity():
    torch.manual_seed(1)
    norms = torch.randn(64, 8)
    sel = select_experts(norms, strategy="expert_choice", top_k=2, capacity_factor=2.0)
    capacity = expert_capacity(64, 8, 2.0)
    assert capacity == 16  # 25% of the batch's tokens per expert
    assert sel.routing_map_TE.sum(0).tolist() == [capacity] * 8
    scores = torch.softmax(norms, dim=-1)
    for e in range(8):  # each expert's tokens are its highest-scoring ones
        mine = scores[sel.routing_map_TE[:, e], e]
        others = scores[~sel.routing_map_TE[:, e], e]
        assert mine.min() >= others.max()
    assert_close(sel.probs_TE, scores * sel.routing_map_TE, rtol=0, atol=0)


def test_random_control_ignores_the_input_and_is_uniform():
    a, b = torch.randn(50, 8), torch.randn(50, 8) * 10
    torch.manual_seed(3)
    sel_a = select_experts(a, strategy="random", top_k=2)
    torch.manual_seed(3)
    sel_b = select_experts(b, strategy="random", top_k=2)
    assert_close(sel_a.routing_map_TE, sel_b.routing_map_TE, rtol=0, atol=0)  # the input changed, not the choice
    big = select_experts(torch.randn(40000, 8), strategy="random", top_k=2)
    assert (big.routing_map_TE.sum(-1) == 2).all()
    load = big.routing_map_TE.float().mean(0)
    assert_close(load, torch.full((8,), 0.25), rtol=1e-5, atol=0.01)  # equal marginal K/E
    assert_close(big.probs_TE.sum(-1), torch.ones(40000), rtol=1e-5, atol=1e-8)


def test_frozen_random_ranking_is_never_updated(megatron_world):
    tc = make_transformer_config(d_model=16, d_ffn=32, num_experts=4, top_k=2)
    torch.manual_seed(0)
    layer = build_aoe_layer(tc, d_low=4, rank_source="frozen_random", alpha_aux=0.01)
    router = layer.router
    frozen, w_down = router.frozen_rank_DER.clone(), router.weight.detach().clone()
    assert "frozen_rank_DER" not in dict(layer.named_parameters())
    assert "router.frozen_rank_DER" in layer.state_dict()  # saved with the model
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    for _ in range(3):
        x = torch.randn(6, 2, 16)
        out, _ = layer(x)
        out.square().sum().backward()
        opt.step()
        opt.zero_grad()
    assert_close(router.frozen_rank_DER, frozen, rtol=0, atol=0)
    assert not torch.equal(router.weight.detach(), w_down)
    # the ranking is the frozen matrix's: top-K of ||x F^i||
    x = torch.randn(10, 16)
    layer.eval()
    _, routing_map, _ = router(x.view(10, 1, 16))
    want = torch.topk(ops.expert_norms(ops.low_rank_cache(x, w_down_DER=frozen, num_experts=4)), 2).indices
    assert_close(routing_map, torch.zeros(10, 4, dtype=torch.bool).scatter(-1, want, True), rtol=0, atol=0)


def test_config3_router_selects_among_aoe_experts(megatron_world):
    tc = make_transformer_config(d_model=16, d_ffn=32, num_experts=4, top_k=2)
    layer = build_aoe_layer(tc, d_low=4, rank_source="router", alpha_aux=0.01)
    x = torch.randn(12, 16)
    probs, routing_map, _ = layer.router(x.view(12, 1, 16))
    logits = x @ layer.router.gate_DE
    top = torch.topk(logits, 2)
    assert_close(routing_map, torch.zeros(12, 4, dtype=torch.bool).scatter(-1, top.indices, True),
                 rtol=0, atol=0)
    assert_close(probs.gather(-1, top.indices), torch.softmax(top.values, -1), rtol=1e-5, atol=1e-8)
    out, _ = layer(x.view(12, 1, 16))
    out.sum().backward()
    assert layer.router.gate_DE.grad.abs().sum() > 0


def _variant_router(**changes):
    from aoe_megatron.models.moe_router import RouterConfig, VariantRouter

    tc = make_transformer_config(d_model=16, d_ffn=32, num_experts=4, top_k=2)
    cfg = replace(RouterConfig(num_experts=4, top_k=2, d_model=16, alpha_aux=0.0), **changes)
    return tc, VariantRouter(config=tc, router=cfg)


def test_config4_router_has_n_dlow_dmodel_parameters(megatron_world):
    _, router = _variant_router(gate="two_layer", hidden_per_expert=8)
    assert router.w1.numel() == 4 * 8 * 16  # n x d_low x d_model, like AoE's W_down
    assert router.w2.numel() == 4 * 8 * 4
    probs, routing_map = router(torch.randn(5, 2, 16))
    assert routing_map.sum(-1).eq(2).all()
    assert_close(probs.sum(-1), torch.ones(10), rtol=1e-5, atol=1e-8)


def test_linear_variant_router_equals_megatron_topk_router(megatron_world):
    from megatron.core.transformer.moe.router import TopKRouter

    tc, ours = _variant_router()
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    theirs = TopKRouter(config=tc, pg_collection=get_default_pg_collection())
    with torch.no_grad():
        theirs.weight.copy_(ours.weight)
    x = torch.randn(7, 3, 16)
    (p1, m1), (p2, m2) = ours(x), theirs(x)
    assert_close(m1, m2, rtol=0, atol=0)
    assert_close(p1, p2, rtol=1e-5, atol=1e-6)


def test_ent_conf_regularizer_adds_its_gradient(megatron_world):
    torch.manual_seed(0)
    x, w = torch.randn(9, 1, 16), torch.randn(9, 4)
    grads = []
    for coeff in (0.0, 0.5):
        _, router = _variant_router(ent_conf_coeff=coeff)
        with torch.no_grad():
            router.weight.copy_(torch.linspace(-1, 1, 64).view(4, 16))
        probs, _ = router(x)
        (probs * w).sum().backward()
        grads.append(router.weight.grad.clone())
    weight = torch.linspace(-1, 1, 64).view(4, 16).requires_grad_()
    ent = 0.5 * ops.confidence_entropy(torch.softmax(x.view(9, 16) @ weight.t(), -1))
    (want,) = torch.autograd.grad(ent, weight)
    assert_close(grads[1] - grads[0], want.float(), rtol=1e-5, atol=1e-6)


def test_switch_jitter_only_in_training(megatron_world):
    _, plain = _variant_router()
    _, jittered = _variant_router(input_jitter=0.01)
    with torch.no_grad():
        jittered.weight.copy_(plain.weight)
    x = torch.randn(50, 1, 16)
    jittered.eval()
    assert_close(jittered(x)[0], plain.eval()(x)[0], rtol=0, atol=0)
    jittered.train()
    with torch.no_grad():
        a, b = jittered(x)[0], jittered(x)[0]
    assert not torch.equal(a, b)
    # multiplicative noise of at most 1%: the logits move by at most 1% of sum |x_d w_d|
    bound = 0.01 * (x.view(50, 16).abs() @ plain.weight.abs().t())
    noisy = torch.stack([jittered.logits(jittered.jitter(x.view(50, 16))) for _ in range(5)])
    assert ((noisy - plain.logits(x.view(50, 16))).abs() <= bound + 1e-6).all()


def test_hash_layer_depends_only_on_the_token_id(megatron_world):
    from aoe_megatron.models.gpt import build_gpt_model, transformer_config
    from aoe_megatron.models.moe_router import VariantRouter

    cfg = _shrunk("hash_moe")
    model = build_gpt_model(cfg, transformer_config(cfg), use_te=False)
    routers = [m for m in model.modules() if isinstance(m, VariantRouter)]
    assert len(routers) == cfg.num_layers and not list(routers[0].parameters())
    ids = torch.tensor([[5, 9, 5, 300], [9, 9, 7, 5]])
    model(ids, torch.arange(4).expand_as(ids), None)
    assert_close(routers[0].token_ids, ids.t().reshape(-1), rtol=0, atol=0)  # the hook's [S, B] order
    router = routers[0]
    maps = []
    for scale in (1.0, -30.0):  # other hidden states, same token ids
        probs, routing_map = router(scale * torch.randn(4, 2, cfg.hidden_size))
        maps.append(routing_map)
    assert_close(maps[0], maps[1], rtol=0, atol=0)
    flat = ids.t().reshape(-1)
    for t in range(flat.numel()):  # the same id anywhere gets the same K experts
        same = (flat == flat[t]).nonzero().flatten()
        for u in same.tolist():
            assert_close(maps[0][t], maps[0][u], rtol=0, atol=0)
    assert (maps[0].sum(-1) == cfg.top_k).all()
    assert_close(probs.sum(-1), torch.ones(8), rtol=1e-5, atol=1e-8)
    table = router.bucket_of_token
    counts = torch.bincount(table, minlength=cfg.num_experts)
    assert counts.max() - counts.min() <= 1  # balanced over the vocabulary


def _loop_reference(x, w_down, w_up, w_p, w_o, *, top_k, factorized="gate", rank="cache"):
    """float64, one token at a time: Algorithm 2 with the rebuttal's expert variants; ``rank``
    "cache" ranks by ||C_i||, "output" by the norm of every expert's final output (FON)."""
    import torch.nn.functional as F

    e, r = w_up.shape[0], w_down.shape[1] // w_up.shape[0]
    rows = []
    for t in range(x.shape[0]):
        xt = x[t]
        outs, norms = [], []
        for i in range(e):
            c = xt @ w_down[:, i * r:(i + 1) * r]
            if factorized == "gate":
                h = F.silu(c @ w_up[i]) * (xt @ w_p[i])
            elif factorized == "up":
                h = F.silu(xt @ w_p[i]) * (c @ w_up[i])
            else:  # none: the cache is the gate pre-activation's first r elements
                h = F.silu(torch.cat([c, xt @ w_up[i]])) * (xt @ w_p[i])
            outs.append(h @ w_o[i])
            norms.append(torch.linalg.vector_norm(outs[-1] if rank == "output" else c))
        norms = torch.stack(norms)
        top = torch.topk(norms, top_k).indices
        weights = torch.softmax(norms[top], dim=0)
        rows.append(sum(w * outs[i] for w, i in zip(weights, top.tolist())))
    return torch.stack(rows)


def _layer_weights64(layer):
    ex = layer.experts
    return [t.detach().double().requires_grad_() for t in (layer.router.weight, ex.w_up, ex.w_p, ex.w_o)]


@pytest.mark.parametrize("factorized", ["up", "none"])
def test_rebuttal_factorizations_match_a_float64_loop(factorized, megatron_world):
    tc = make_transformer_config(d_model=16, d_ffn=24, num_experts=4, top_k=2, dtype=torch.float64)
    torch.manual_seed(0)
    layer = build_aoe_layer(tc, d_low=4, factorized=factorized)
    if factorized == "none":
        assert layer.experts.w_up.shape == (4, 16, 24 - 4)  # W_g's other columns; d_wide = d_ffn
    x = torch.randn(10, 16, dtype=torch.float64, requires_grad=True)
    out, _ = layer(x.view(10, 1, 16))
    weights = _layer_weights64(layer)
    x_ref = x.detach().clone().requires_grad_()
    want = _loop_reference(x_ref, *weights, top_k=2, factorized=factorized)
    assert_close(out.view(10, 16), want, rtol=1e-5, atol=1e-10)
    g = torch.randn(10, 16, dtype=torch.float64)
    (out.view(10, 16) * g).sum().backward()
    (want * g).sum().backward()
    assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-10)
    mine = [layer.router.weight.grad, layer.experts.w_up.grad, layer.experts.w_p.grad, layer.experts.w_o.grad]
    for got, ref in zip(mine, weights):
        assert_close(got, ref.grad, rtol=1e-5, atol=1e-10)


def test_fon_selection_equals_ranking_every_expert_by_its_output(megatron_world):
    tc = make_transformer_config(d_model=16, d_ffn=24, num_experts=4, top_k=2, dtype=torch.float64)
    torch.manual_seed(1)
    layer = build_aoe_layer(tc, d_low=4, inference_selection="fon").eval()
    x = torch.randn(12, 16, dtype=torch.float64)
    with torch.no_grad():
        out, _ = layer(x.view(12, 1, 16))
        by_cache, _ = layer.train()(x.view(12, 1, 16))  # training still ranks by the cache
    want = _loop_reference(x, *[w.detach() for w in _layer_weights64(layer)], top_k=2, rank="output")
    assert_close(out.view(12, 16), want, rtol=1e-5, atol=1e-10)
    assert not torch.allclose(out, by_cache)  # on this draw the two selections differ


def test_imitation_router_learns_from_detached_inputs_and_selects_alone(megatron_world):
    tc = make_transformer_config(d_model=16, d_ffn=24, num_experts=4, top_k=2)
    torch.manual_seed(2)
    x = torch.randn(64, 16)
    grads = []
    for coeff in (0.0, 1.0):  # the imitation loss changes no gradient but the router's
        torch.manual_seed(3)
        layer = build_aoe_layer(tc, d_low=4, inference_selection="router", imitation_coeff=coeff)
        xi = x.clone().requires_grad_()
        out, _ = layer(xi.view(64, 1, 16))
        out.sum().backward()
        grads.append((xi.grad, layer.router.weight.grad, layer.router.imitation_DE.grad))
    assert_close(grads[0][0], grads[1][0], rtol=0, atol=0)
    assert_close(grads[0][1], grads[1][1], rtol=0, atol=0)
    assert grads[0][2] is None or not grads[0][2].any()
    assert grads[1][2].abs().sum() > 0

    router = layer.router
    with torch.no_grad():  # trained-model-like norms (at init they are all tiny: a flat target)
        router.weight.mul_(30)
    opt = torch.optim.Adam([router.imitation_DE], lr=0.05)

    def imitation_loss():  # cross-entropy to the softmax over the norms
        with torch.no_grad():
            norms = ops.expert_norms(ops.low_rank_cache(x, w_down_DER=router.weight, num_experts=4))
            logp = torch.log_softmax(x @ router.imitation_DE, -1)
            return -(torch.softmax(norms, -1) * logp).sum(-1).mean().item()

    before = imitation_loss()
    for _ in range(200):
        layer.train()
        out, _ = layer(x.view(64, 1, 16))
        out.sum().backward()
        opt.step()
        opt.zero_grad()
    # it learns what a linear router can (norms are even in x, logits odd: it cannot learn it all,
    # which is the rebuttal's point)
    assert imitation_loss() < before - 0.1
    layer.eval()
    with torch.no_grad():
        probs, routing_map, _ = router(x.view(64, 1, 16))
    want = torch.topk(x @ router.imitation_DE, 2).indices
    assert_close(routing_map, torch.zeros(64, 4, dtype=torch.bool).scatter(-1, want, True), rtol=0, atol=0)


# ----------------------------------------------------------------------------- every preset


def _shrunk(name: str):
    """The preset at CPU size: hidden 96 instead of 768, d_low and router widths scaled alike."""
    from aoe_megatron.models.gpt import load_preset

    cfg = load_preset(f"ablations/{name}")
    scale = 96 / cfg.hidden_size
    changes = dict(num_layers=2, hidden_size=96, num_attention_heads=4, ffn_hidden_size=128,
                   num_experts=4, seq_length=16, vocab_size=512,
                   aoe={"d_low": max(2, int(cfg.aoe.d_low * scale))})
    if cfg.router.hidden_per_expert:
        changes["router"] = {"hidden_per_expert": max(2, int(cfg.router.hidden_per_expert * scale))}
    return cfg.with_overrides(**changes)


def _train_step(name: str, ep: int) -> float:
    from aoe_megatron.models.gpt import build_gpt_model, transformer_config

    cfg = _shrunk(name)
    torch.manual_seed(0)
    model = build_gpt_model(cfg, transformer_config(cfg, expert_parallel_size=ep), use_te=False)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length))
    positions = torch.arange(cfg.seq_length).expand_as(tokens)
    loss = model(tokens, positions, None, labels=tokens).float().mean()
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads), name
    assert torch.isfinite(loss), name
    if ep == 1:  # what params.py counts (README's ablation table) is what is allocated
        from aoe_megatron.models.params import count_parameters

        assert sum(p.numel() for p in model.parameters()) == count_parameters(cfg).total, name
    model.eval()  # evaluation-time selections (FON, the imitation router) too
    if ep > 1 and cfg.arch == "aoe" and cfg.aoe.inference_selection == "fon":
        with pytest.raises(ValueError, match="EP=1 only"):
            model(tokens, positions, None)
    else:
        with torch.no_grad():
            assert torch.isfinite(model(tokens, positions, None)).all(), name
    return loss.item()


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.legs)
                                  if n.startswith(("topp", "expert_choice")) else n for n in ABLATIONS])
def test_every_ablation_preset_trains_a_step_at_ep1(name, megatron_world):
    _train_step(name, 1)


def _all_presets_at_ep2(rank, world_size):
    for name in ABLATIONS:
        _train_step(name, 2)


@pytest.mark.legs
@pytest.mark.slow
@pytest.mark.distributed
def test_every_ablation_preset_trains_a_step_at_ep2():
    run_distributed(_all_presets_at_ep2, 2)


def _dispatch_and_combine(routing_TE, x_TD, *, variable_count: bool):
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

    from aoe_megatron.moe.dispatcher import PairCountingAlltoAllTokenDispatcher

    e = routing_TE.shape[1]
    tc = make_transformer_config(d_model=x_TD.shape[1], num_experts=e, top_k=1)
    disp = PairCountingAlltoAllTokenDispatcher(e, list(range(e)), config=tc,
                                               pg_collection=get_default_pg_collection())
    disp.variable_count = variable_count
    h, p = disp.dispatch_preprocess(x_TD.unsqueeze(1), routing_TE, routing_TE.float())
    h, p = disp.token_dispatch(h, p)
    h, counts, p = disp.dispatch_postprocess(h, p)
    out = disp.combine_postprocess(disp.token_combine(disp.combine_preprocess(h)))
    return out.squeeze(1), counts


@pytest.mark.legs
def test_every_pair_is_dispatched_when_tokens_get_any_number_of_experts(megatron_world):
    """Top-p and expert choice give a token any number of experts (here 0 to 4 at top_k 1):
    every selected pair reaches its expert and comes back, so dispatch then combine sums each
    token once per expert. megatron-core 0.19.2's dropless permute keeps exactly T * top_k rows
    unless the dispatcher counts the pairs (0.16.1 kept them all either way)."""
    from aoe_megatron.runtime.versions import mcore_at_least

    routing_TE = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0], [0, 1, 1, 1],
                               [1, 1, 1, 1], [0, 0, 1, 0]], dtype=torch.bool)
    x_TD = torch.randn(6, 8)
    out, counts = _dispatch_and_combine(routing_TE, x_TD, variable_count=True)
    assert counts.tolist() == routing_TE.sum(0).tolist()
    assert_close(out, x_TD * routing_TE.sum(1, keepdim=True))
    if not mcore_at_least("0.17"):
        uncounted, _ = _dispatch_and_combine(routing_TE, x_TD, variable_count=False)
        assert_close(uncounted, x_TD * routing_TE.sum(1, keepdim=True))
        return
    try:  # T * top_k = 6 of the 12 pairs kept: wrong rows, or (here) sizes that disagree
        uncounted, _ = _dispatch_and_combine(routing_TE, x_TD, variable_count=False)
    except RuntimeError as exc:
        assert "split" in str(exc), exc
    else:
        assert not torch.allclose(uncounted, x_TD * routing_TE.sum(1, keepdim=True))
