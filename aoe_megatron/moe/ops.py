"""AoE math as pure functions on tensors (no modules, no process groups).

Shape suffixes used in every tensor name:
    T tokens, N dispatched (token, expert) pairs, D d_model, E experts, K top-k,
    R d_low (the low-rank cache width), W d_wide (the expert's wide hidden size), F d_ffn.

Paper: "Autonomy-of-Experts Models", arXiv 2501.13074 (Algorithm 2, Eqs. 3-8).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

NORM_ORDERS = ("l2", "l1", "linf")


def d_wide_for_parity(*, d_model: int, d_ffn: int, d_low: int) -> int:
    """Eq. 5: the d_wide that gives an AoE expert the parameters of a SwiGLU expert of width d_ffn.

        d_wide = (3 d_model d_ffn - d_low d_model) / (d_low + 2 d_model)

    NOTE: rounded up, so AoE never has fewer parameters than MoE. This reproduces the paper's
    values: d_low=256 -> 3840 (exact) for the 732M model, d_low=400 -> 6470 (6469.2) for the 4B.
    """
    numerator = 3 * d_model * d_ffn - d_low * d_model
    if numerator <= 0:
        raise ValueError(
            f"Eq. 5 has no positive d_wide for d_low={d_low}, d_model={d_model}, d_ffn={d_ffn}."
        )
    return math.ceil(numerator / (d_low + 2 * d_model))


D_WIDE_ROUNDING = ("up", "nearest")


def round_to_multiple(width: int, *, multiple: int, mode: str = "up") -> int:
    """``width`` rounded to a multiple of ``multiple``: "up" (an AoE expert never gets fewer
    parameters than Eq. 5's) or "nearest" (the closest parity; halves round up; at least one
    ``multiple``). At the 4B shape Eq. 5 gives 6470: 64 rounds it up to 6528 and to the nearest
    6464."""
    if mode not in D_WIDE_ROUNDING:
        raise ValueError(f"unknown d_wide rounding {mode!r}; choose one of {D_WIDE_ROUNDING}")
    if mode == "up":
        return -(-width // multiple) * multiple
    return max(multiple, (2 * width + multiple) // (2 * multiple) * multiple)


def low_rank_cache(x_TD: torch.Tensor, *, w_down_DER: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Eq. 4: C = x [W_down^1, ..., W_down^E], one matmul for all experts, reshaped to [T, E, R]."""
    cache_TER = x_TD @ w_down_DER
    return cache_TER.view(x_TD.shape[0], num_experts, -1)


def expert_norms(cache_TER: torch.Tensor, *, order: str = "l2") -> torch.Tensor:
    """Algorithm 2, line 7: p_i = ||C_i|| per token and expert (L2; L1 and L-inf from Appendix A).

    Computed in float32 at least, so bf16 caches rank experts stably.
    """
    c = cache_TER.float() if cache_TER.dtype in (torch.float16, torch.bfloat16) else cache_TER
    if order == "l2":
        return torch.linalg.vector_norm(c, ord=2, dim=-1)
    if order == "l1":
        return torch.linalg.vector_norm(c, ord=1, dim=-1)
    if order == "linf":
        return torch.linalg.vector_norm(c, ord=float("inf"), dim=-1)
    raise ValueError(f"unknown norm order {order!r}; choose one of {NORM_ORDERS}")


def load_balancing_loss(
    *, routing_map_TE: torch.Tensor, scores_TE: torch.Tensor, alpha: float
) -> torch.Tensor:
    """Eq. 6: L_aux = alpha * E * sum_i f_i P_i.

    f_i = (1/T) sum_x 1{i in selected(x)}   (from the selection; sums to K over experts)
    P_i = (1/T) sum_x softmax(||x W_down||)_i (softmax over *all* experts' norms)
    """
    num_tokens, num_experts = scores_TE.shape
    f_E = routing_map_TE.to(scores_TE.dtype).sum(0) / num_tokens
    p_E = scores_TE.sum(0) / num_tokens
    return alpha * num_experts * torch.sum(f_E * p_E)


def updated_expert_bias(bias_E: torch.Tensor, tokens_E: torch.Tensor, rate: float) -> torch.Tensor:
    """Aux-loss-free balancing's update (DeepSeek-V3, Wang et al. 2024; megatron-core's
    ``get_updated_expert_bias`` without its all-reduce): each expert's bias moves by ``rate``
    toward balance, up for an expert below the mean load, down above it (``tokens_E``: the step's
    token counts over every rank; any leading dimensions, experts last)."""
    mean = tokens_E.sum(-1, keepdim=True) / tokens_E.shape[-1]
    return bias_E + rate * torch.sign(mean - tokens_E).to(bias_E.dtype)


def load_fractions(routing_map_TE: torch.Tensor) -> torch.Tensor:
    """f_i of Eqs. 6-7 normalised to a distribution: the share of selections expert i received."""
    counts_E = routing_map_TE.to(torch.float64).sum(0)
    return counts_E / counts_E.sum().clamp_min(1)


def load_entropy(routing_map_TE: torch.Tensor) -> torch.Tensor:
    """Eq. 7: Ent_load = -sum_i f_i log f_i, with f the normalised load (0 log 0 = 0).

    NOTE: f is normalised to sum to 1 (the paper's reported values, about 2.02 for 8 experts, lie
    below log 8 = 2.079, which only a normalised f allows).
    """
    f_E = load_fractions(routing_map_TE)
    return -torch.sum(torch.where(f_E > 0, f_E * torch.log(f_E), torch.zeros_like(f_E)))


def confidence_entropy(scores_TE: torch.Tensor) -> torch.Tensor:
    """Eq. 8: Ent_conf = -sum_i p_i log p_i per token, averaged over tokens.

    p = softmax(||x W_down^i||) over all experts for AoE (softmax of router logits for MoE).
    """
    p = scores_TE.to(torch.float64)
    ent_T = -torch.sum(torch.where(p > 0, p * torch.log(p), torch.zeros_like(p)), dim=-1)
    return ent_T.mean()


FACTORIZATIONS = ("gate", "up", "none")


def aoe_expert(
    x_ND: torch.Tensor,
    cache_NR: torch.Tensor,
    *,
    w_up_RW: torch.Tensor,
    w_p_DW: torch.Tensor,
    w_o_WD: torch.Tensor,
    factorized: str = "gate",
) -> torch.Tensor:
    """Eq. 3 after the cache: E_i(x) = (SiLU(C_i W_up^i) * (x W_p^i)) W_o^i ("gate": the paper).

    The rebuttal's variants: "up" factorizes W_p instead (SiLU(x W_p^i) * (C_i W_up^i)) W_o^i,
    with ``w_p_DW`` the full gate projection; "none" factorizes nothing: the cache is the first
    d_low elements of the gate pre-activation x W_g^i, and ``w_up_RW`` holds W_g^i's other
    columns ([D, W - d_low]): (SiLU([C_i, x W_up^i]) * (x W_p^i)) W_o^i.
    """
    if factorized == "gate":
        hidden = F.silu(cache_NR @ w_up_RW) * (x_ND @ w_p_DW)
    elif factorized == "up":
        hidden = F.silu(x_ND @ w_p_DW) * (cache_NR @ w_up_RW)
    elif factorized == "none":
        hidden = F.silu(torch.cat([cache_NR, x_ND @ w_up_RW], dim=-1)) * (x_ND @ w_p_DW)
    else:
        raise ValueError(f"unknown factorization {factorized!r}; choose one of {FACTORIZATIONS}")
    return hidden @ w_o_WD
