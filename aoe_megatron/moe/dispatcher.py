"""AoE token dispatchers: megatron-core's allgather and all-to-all dispatchers, carrying the cache.

In cache mode "send", each dispatched row is [x | C_i]: the token's hidden state followed by the
slice of the low-rank cache that belongs to the expert the row goes to, so the expert never
recomputes x W_down^i and the gradient of C_i returns to W_down through the reverse collective
with no extra code. In cache mode "recompute" the dispatchers send x only, exactly as upstream.

Shape suffixes: T tokens, N dispatched (token, expert) pairs, D d_model, E experts, R d_low.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.moe.token_dispatcher import (
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
)


def pair_cache(cache_TER: torch.Tensor, routing_map_TE: torch.Tensor) -> torch.Tensor:
    """C_i for every (token, expert) pair, in megatron-core's permute order.

    Upstream's (non-fused) ``permute`` orders rows expert-major, tokens ascending within an
    expert: exactly the order of a boolean mask over the [E, T] transpose.
    """
    return cache_TER.transpose(0, 1)[routing_map_TE.transpose(0, 1)]


class PairCountingAlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """megatron-core's all-to-all dispatcher, for selections where a token gets any number of
    experts (``variable_count``: top-p, expert choice).

    NOTE: in dropless training upstream sizes the permuted rows statically, T * top_k
    (``num_out_tokens``). megatron-core 0.16.1's unfused permute ignored that and kept every
    selected pair; 0.19.2's keeps exactly ``num_out_tokens`` rows (argsort-based, for CUDA
    graphs), which drops pairs or adds unselected ones when the count varies. Here the count is
    the routing map's, where it varies (a device-to-host sync, which fixed top-k does without).
    """

    variable_count = False

    def preprocess(self, routing_map: torch.Tensor):
        tokens_per_expert = super().preprocess(routing_map)
        if self.variable_count:
            self.num_out_tokens = int(routing_map.sum())
        return tokens_per_expert


class AoEAlltoAllTokenDispatcher(PairCountingAlltoAllTokenDispatcher):
    """All-to-all over EP; rows are [x | C_i] in cache mode "send"."""

    def dispatch_preprocess(
        self,
        hidden_states: torch.Tensor,
        routing_map: torch.Tensor,
        probs: torch.Tensor,
        cache_TER: Optional[torch.Tensor] = None,
    ):
        tokens_ND, probs_N = super().dispatch_preprocess(hidden_states, routing_map, probs)
        if cache_TER is None:
            return tokens_ND, probs_N
        cache_NR = pair_cache(cache_TER, self.routing_map).to(tokens_ND.dtype)
        return torch.cat([tokens_ND, cache_NR], dim=-1), probs_N


class AoEAllGatherTokenDispatcher(MoEAllGatherTokenDispatcher):
    """All-gather over TP x EP; in cache mode "send" every token carries its whole cache [E * R].

    NOTE: an all-gather sends every rank the same rows, so each token must carry all experts'
    slices (E * R wide); with many experts cache mode "recompute" communicates less.
    """

    def __init__(self, *args, d_model: int, num_experts: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.d_model = d_model
        self.num_experts = num_experts
        self.carries_cache = False

    def dispatch_preprocess(
        self,
        hidden_states: torch.Tensor,
        routing_map: torch.Tensor,
        probs: torch.Tensor,
        cache_TER: Optional[torch.Tensor] = None,
    ):
        tokens_TD, probs_TE = super().dispatch_preprocess(hidden_states, routing_map, probs)
        self.carries_cache = cache_TER is not None
        if cache_TER is None:
            return tokens_TD, probs_TE
        wide = torch.cat([tokens_TD, cache_TER.flatten(1).to(tokens_TD.dtype)], dim=-1)
        return wide, probs_TE

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        if not self.carries_cache:
            return super().dispatch_postprocess(hidden_states, probs)
        x_TD = hidden_states[:, : self.d_model]
        cache_TER = hidden_states[:, self.d_model :].reshape(x_TD.shape[0], self.num_experts, -1)
        permuted_ND, tokens_per_expert, local_probs = super().dispatch_postprocess(x_TD, probs)
        first, last = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        cache_NR = pair_cache(cache_TER[:, first:last], self.local_map)
        return torch.cat([permuted_ND, cache_NR], dim=-1), tokens_per_expert, local_probs
