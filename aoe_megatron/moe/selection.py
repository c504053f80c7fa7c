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
_VARIABLE_COUNT: set = set()


def register_selection(name: str, *, variable_count: bool = False) -> Callable[[SelectionFn], SelectionFn]:
    """Decorator: make a strategy available to configurations under ``name``.
    ``variable_count``: a token gets any number of experts, not exactly top_k."""

    def wrap(fn: SelectionFn) -> SelectionFn:
        if name in _STRATEGIES:
            raise ValueError(f"selection strategy {name!r} is registered twice")
        _STRATEGIES[name] = fn
        if variable_count:
            _VARIABLE_COUNT.add(name)
        return fn

    return wrap


def selects_top_k_per_token(name: str) -> bool:
    """Whether strategy ``name`` gives every token exactly top_k experts (False: top-p, expert
    choice)."""
    get_selection(name)
    return name not in _VARIABLE_COUNT


def selection_strategies() -> tuple[str, ...]:
    return tuple(sorted(_STRATEGIES))


def get_selection(name: str) -> SelectionFn:
    try:
        return _STRATEGIES[name]
    except KeyError:
        raise ValueError(
            f"unknown expert-selection strategy {name!r}; known: {', '.join(selection_strategies())}"
        ) from None


#: The strategies that take ``choice_bias_E`` (aux-loss-free balancing's per-expert bias).
BIASABLE = ("topk_softmax", "softmax_topk")


def _top_k_mask(norms_TE: torch.Tensor, top_k: int,
                choice_bias_E=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-K experts per token, chosen by ``norms + choice_bias_E`` when a bias is given."""
    chooser_TE = norms_TE if choice_bias_E is None else norms_TE + choice_bias_E.to(norms_TE.dtype)
    top_idx_TK = torch.topk(chooser_TE, k=top_k, dim=-1).indices
    mask_TE = torch.zeros_like(norms_TE, dtype=torch.bool).scatter(-1, top_idx_TK, True)
    return top_idx_TK, mask_TE


@register_selection("topk_softmax")
def topk_then_softmax(norms_TE: torch.Tensor, *, top_k: int, choice_bias_E=None) -> Selection:
    """The paper's Algorithm 2 (lines 8-9): I = argtopK(p); weights = softmax(p[I]). With
    ``choice_bias_E`` (aux-loss-free balancing) I = argtopK(p + b), the weights still softmax(p[I])."""
    top_idx_TK, mask_TE = _top_k_mask(norms_TE, top_k, choice_bias_E)
    weights_TK = torch.softmax(norms_TE.gather(-1, top_idx_TK), dim=-1)
    probs_TE = torch.zeros_like(norms_TE).scatter(-1, top_idx_TK, weights_TK)
    return Selection(probs_TE, mask_TE, torch.softmax(norms_TE, dim=-1))


@register_selection("softmax_topk")
def softmax_then_topk(norms_TE: torch.Tensor, *, top_k: int, choice_bias_E=None) -> Selection:
    """The authors' released variant: softmax over all norms, keep the top-K (by norms +
    ``choice_bias_E`` when given), no renormalisation."""
    scores_TE = torch.softmax(norms_TE, dim=-1)
    top_idx_TK, mask_TE = _top_k_mask(norms_TE, top_k, choice_bias_E)
    probs_TE = torch.zeros_like(scores_TE).scatter(-1, top_idx_TK, scores_TE.gather(-1, top_idx_TK))
    return Selection(probs_TE, mask_TE, scores_TE)


@register_selection("top_p", variable_count=True)
def top_p(norms_TE: torch.Tensor, *, top_k: int, p: float = 0.6) -> Selection:
    """Top-P token choice (Huang et al. 2024, paper Appendix B): per token, the smallest set of
    experts whose softmax probabilities reach ``p`` (at least one); weights are those
    probabilities, not renormalised. ``top_k`` is unused: the number of experts varies."""
    if not 0 < p <= 1:
        raise ValueError(f"top_p needs 0 < p <= 1, got {p}")
    scores_TE = torch.softmax(norms_TE, dim=-1)
    sorted_TE, order_TE = torch.sort(scores_TE, dim=-1, descending=True)
    before_TE = torch.cumsum(sorted_TE, dim=-1) - sorted_TE  # mass of the experts ranked above
    keep_sorted_TE = before_TE < p
    mask_TE = torch.zeros_like(keep_sorted_TE).scatter(-1, order_TE, keep_sorted_TE)
    return Selection(scores_TE * mask_TE, mask_TE, scores_TE)


def expert_capacity(num_tokens: int, num_experts: int, capacity_factor: float) -> int:
    """Tokens each expert takes under expert choice: capacity_factor * T / E (at least 1)."""
    return max(1, min(num_tokens, round(capacity_factor * num_tokens / num_experts)))


@register_selection("expert_choice", variable_count=True)
def expert_choice(norms_TE: torch.Tensor, *, top_k: int, capacity_factor: float = 2.0) -> Selection:
    """Expert choice (Zhou et al. 2022): every expert takes the ``capacity_factor * T / E`` tokens
    with the highest probability for it (softmax over experts per token); a token may get any
    number of experts, none included. Weights are those probabilities. The choice looks at the
    whole batch, later tokens included: a causal LM cannot decode this way (see the README)."""
    scores_TE = torch.softmax(norms_TE, dim=-1)
    num_tokens, num_experts = scores_TE.shape
    capacity = expert_capacity(num_tokens, num_experts, capacity_factor)
    top_idx_CE = torch.topk(scores_TE, k=capacity, dim=0).indices
    mask_TE = torch.zeros_like(scores_TE, dtype=torch.bool).scatter(0, top_idx_CE, True)
    return Selection(scores_TE * mask_TE, mask_TE, scores_TE)


@register_selection("random")
def random_selection(norms_TE: torch.Tensor, *, top_k: int, generator=None) -> Selection:
    """The review's control (a): K experts per token drawn uniformly at random, independent of the
    input (equal marginal probability K/E per expert); the drawn experts are weighted by a softmax
    over their norms, as in Algorithm 2, so W_down still learns. Draws come from ``generator`` or
    torch's default generator (whose state activation recompute restores)."""
    noise_TE = torch.rand(norms_TE.shape, generator=generator, device=norms_TE.device)
    top_idx_TK = torch.topk(noise_TE, k=top_k, dim=-1).indices
    mask_TE = torch.zeros_like(norms_TE, dtype=torch.bool).scatter(-1, top_idx_TK, True)
    weights_TK = torch.softmax(norms_TE.gather(-1, top_idx_TK), dim=-1)
    probs_TE = torch.zeros_like(norms_TE).scatter(-1, top_idx_TK, weights_TK)
    return Selection(probs_TE, mask_TE, torch.softmax(norms_TE, dim=-1))


@register_selection("hash")
def hash_selection(norms_TE: torch.Tensor, *, top_k: int, buckets_T=None) -> Selection:
    """Hash layer (Roller et al. 2021): a token's experts depend only on its id, through a fixed
    bucket per token id (``buckets_T``, from the router's table): experts bucket, bucket + 1, ...
    (mod E), K of them, equally weighted. The norms are not looked at."""
    num_tokens, num_experts = norms_TE.shape
    if buckets_T is None:  # a configuration dry run
        buckets_T = torch.zeros(num_tokens, dtype=torch.long, device=norms_TE.device)
    idx_TK = (buckets_T.view(-1, 1) + torch.arange(top_k, device=norms_TE.device)) % num_experts
    mask_TE = torch.zeros_like(norms_TE, dtype=torch.bool).scatter(-1, idx_TK, True)
    probs_TE = mask_TE.to(norms_TE.dtype) / top_k
    return Selection(probs_TE, mask_TE, probs_TE)


def select_experts(norms_TE: torch.Tensor, *, strategy: str, top_k: int, **options) -> Selection:
    """Run the named strategy on per-expert norms; ``options`` go to the strategy."""
    return get_selection(strategy)(norms_TE, top_k=top_k, **options)


def check_options(strategy: str, *, num_experts: int, top_k: int, options: dict) -> None:
    """Raise (TypeError / ValueError) unless ``strategy`` accepts ``options``: a two-token dry
    run. NOTE: on a forked RNG: a config is built after the run's ``torch.manual_seed``, and a
    strategy that draws (``random``) would otherwise shift every weight initialised after it
    (the random control would not start from the other arms' shared weights)."""
    with torch.random.fork_rng(devices=[]):
        select_experts(torch.zeros(2, num_experts), strategy=strategy, top_k=top_k, **options)
