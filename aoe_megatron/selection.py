"""Expert-selection strategies: from per-expert norms to weights and a routing map.

A strategy is a pure function ``fn(norms_TE, *, top_k, **options) -> Selection`` registered by
name; configurations name it as data. Later strategies (top-P, expert choice, random and frozen
controls) register here the same way and take their own keyword options (a threshold P, a
capacity, a seed).

Shape suffixes: T tokens, E experts, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict

import torch


@dataclass(frozen=True)
class Selection:
    """The outcome of expert selection for a batch of tokens.

    probs_TE: weight of each expert in a token's output, zero where not selected.
    routing_map_TE: True where the token is sent to the expert.
    scores_TE: softmax over *all* experts' norms (P_i of Eq. 6 and p of Eq. 8).
    """

    probs_TE: torch.Tensor
    routing_map_TE: torch.Tensor
    scores_TE: torch.Tensor


SelectionFn = Callable[..., Selection]
_STRATEGIES: Dict[str, SelectionFn] = {}


def register_selection(name: str) -> Callable[[SelectionFn], SelectionFn]:
    """Decorator: make a strategy available to configurations under ``name``."""

    def wrap(fn: SelectionFn) -> SelectionFn:
        if name in _STRATEGIES:
            raise ValueError(f"selection strategy {name!r} is registered twice")
        _STRATEGIES[name] = fn
        return fn

    return wrap


def selection_strategies() -> tuple[str, ...]:
    return tuple(sorted(_STRATEGIES))


def get_selection(name: str) -> SelectionFn:
    try:
        return _STRATEGIES[name]
    except KeyError:
        raise ValueError(
            f"unknown expert-selection strategy {name!r}; known: {', '.join(selection_strategies())}"
        ) from None


def _top_k_mask(norms_TE: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    top_idx_TK = torch.topk(norms_TE, k=top_k, dim=-1).indices
    mask_TE = torch.zeros_like(norms_TE, dtype=torch.bool).scatter(-1, top_idx_TK, True)
    return top_idx_TK, mask_TE


@register_selection("topk_softmax")
def topk_then_softmax(norms_TE: torch.Tensor, *, top_k: int) -> Selection:
    """The paper's Algorithm 2 (lines 8-9): I = argtopK(p); weights = softmax(p[I])."""
    top_idx_TK, mask_TE = _top_k_mask(norms_TE, top_k)
    weights_TK = torch.softmax(norms_TE.gather(-1, top_idx_TK), dim=-1)
    probs_TE = torch.zeros_like(norms_TE).scatter(-1, top_idx_TK, weights_TK)
    return Selection(probs_TE, mask_TE, torch.softmax(norms_TE, dim=-1))


@register_selection("softmax_topk")
def softmax_then_topk(norms_TE: torch.Tensor, *, top_k: int) -> Selection:
    """The authors' released variant: softmax over all norms, keep the top-K, no renormalisation."""
    scores_TE = torch.softmax(norms_TE, dim=-1)
    top_idx_TK, mask_TE = _top_k_mask(norms_TE, top_k)
    probs_TE = torch.zeros_like(scores_TE).scatter(-1, top_idx_TK, scores_TE.gather(-1, top_idx_TK))
    return Selection(probs_TE, mask_TE, scores_TE)


def select_experts(norms_TE: torch.Tensor, *, strategy: str, top_k: int, **options) -> Selection:
    """Run the named strategy on per-expert norms; ``options`` go to the strategy."""
    return get_selection(strategy)(norms_TE, top_k=top_k, **options)
