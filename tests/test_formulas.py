"""L_aux (Eq. 6), Ent_load (Eq. 7), Ent_conf (Eq. 8), Eq. 5 and the selection strategies by hand."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from aoe_megatron.moe import ops
from aoe_megatron.moe.selection import register_selection, select_experts, selection_strategies

NORMS = torch.tensor([[3.0, 1.0, 2.0, 0.5], [0.1, 0.2, 4.0, 3.0], [1.0, 5.0, 0.0, 2.0]])


def test_topk_softmax_is_algorithm_2():
    sel = select_experts(NORMS, strategy="topk_softmax", top_k=2)
    e2 = math.exp(2.0) + math.exp(3.0)
    assert sel.routing_map_TE[0].tolist() == [True, False, True, False]
    assert_close(sel.probs_TE[0], torch.tensor([math.exp(3) / e2, 0, math.exp(2) / e2, 0]))
    assert_close(sel.probs_TE.sum(-1), torch.ones(3))
    assert_close(sel.scores_TE, torch.softmax(NORMS, -1))


def test_softmax_topk_is_the_released_variant():
    sel = select_experts(NORMS, strategy="softmax_topk", top_k=2)
    full = torch.softmax(NORMS, -1)
    assert_close(sel.probs_TE[1], torch.tensor([0.0, 0.0, full[1, 2], full[1, 3]]))
    assert (sel.probs_TE.sum(-1) < 1).all()  # no renormalisation


def test_registry_rejects_duplicates_and_lists_strategies():
    assert {"topk_softmax", "softmax_topk"} <= set(selection_strategies())
    with pytest.raises(ValueError, match="registered twice"):
        register_selection("topk_softmax")(lambda norms, *, top_k: None)
    with pytest.raises(ValueError, match="unknown expert-selection strategy"):
        select_experts(NORMS, strategy="nope", top_k=1)


def test_aux_loss_is_eq6_by_hand():
    sel = select_experts(NORMS, strategy="topk_softmax", top_k=2)
    # Selections: token0 {0,2}, token1 {2,3}, token2 {1,3} -> f = [1/3, 1/3, 2/3, 2/3]
    f = [1 / 3, 1 / 3, 2 / 3, 2 / 3]
    p = torch.softmax(NORMS.double(), -1).mean(0).tolist()
    expected = 0.01 * 4 * sum(fi * pi for fi, pi in zip(f, p))
    got = ops.load_balancing_loss(routing_map_TE=sel.routing_map_TE, scores_TE=sel.scores_TE,
                                  alpha=0.01)
    assert got.item() == pytest.approx(expected, rel=1e-6)


def test_entropies_are_eq7_and_eq8():
    sel = select_experts(NORMS, strategy="topk_softmax", top_k=2)
    f = torch.tensor([1, 1, 2, 2], dtype=torch.float64) / 6
    assert ops.load_entropy(sel.routing_map_TE).item() == pytest.approx(-(f * f.log()).sum().item())
    balanced = torch.eye(4, dtype=torch.bool)
    assert ops.load_entropy(balanced).item() == pytest.approx(math.log(4))
    collapsed = torch.zeros(4, 4, dtype=torch.bool)
    collapsed[:, 0] = True
    assert ops.load_entropy(collapsed).item() == 0.0
    p = torch.softmax(NORMS.double(), -1)
    per_token = [-(row * row.log()).sum().item() for row in p]
    assert ops.confidence_entropy(p).item() == pytest.approx(sum(per_token) / 3)
    assert ops.confidence_entropy(torch.full((2, 8), 1 / 8)).item() == pytest.approx(math.log(8))


def test_norm_orders():
    c = torch.tensor([[[3.0, -4.0], [1.0, 1.0]]])
    assert_close(ops.expert_norms(c, order="l2"), torch.tensor([[5.0, math.sqrt(2)]]))
    assert_close(ops.expert_norms(c, order="l1"), torch.tensor([[7.0, 2.0]]))
    assert_close(ops.expert_norms(c, order="linf"), torch.tensor([[4.0, 1.0]]))
    assert ops.expert_norms(c.bfloat16(), order="l2").dtype == torch.float32
    with pytest.raises(ValueError, match="unknown norm order"):
        ops.expert_norms(c, order="l3")


def test_low_rank_cache_is_one_matmul_of_stacked_w_down():
    x = torch.randn(5, 8, dtype=torch.float64)
    w = torch.randn(8, 3 * 4, dtype=torch.float64)
    cache = ops.low_rank_cache(x, w_down_DER=w, num_experts=3)
    for i in range(3):
        assert_close(cache[:, i], x @ w[:, i * 4 : (i + 1) * 4])


def test_eq5_gives_parameter_parity():
    for d_model, d_ffn, d_low in ((768, 3072, 64), (768, 3072, 256), (1280, 5120, 400)):
        w = ops.d_wide_for_parity(d_model=d_model, d_ffn=d_ffn, d_low=d_low)
        aoe = d_model * d_low + d_low * w + 2 * d_model * w
        moe = 3 * d_model * d_ffn
        assert 0 <= aoe - moe < d_low + 2 * d_model  # parity up to one column of rounding
    with pytest.raises(ValueError, match="no positive d_wide"):
        ops.d_wide_for_parity(d_model=4, d_ffn=1, d_low=20)
