"""The AoE "router": no router weights, only the stacked W_down that every expert owns a slice of.

It computes the low-rank cache of all experts in one matmul (Eq. 4), ranks experts by the norm of
their slice (Algorithm 2), applies the load-balancing loss of Eq. 6 and returns megatron-core's
``(probs, routing_map)`` plus the cache, which the AoE layer hands to its token dispatcher.

Shape suffixes: T tokens, D d_model, E experts, R d_low.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    save_to_aux_losses_tracker,
)

from aoe_megatron import ops
from aoe_megatron.config import AoEConfig
from aoe_megatron.init import draw_module_seed, expert_normal_, target_device
from aoe_megatron.selection import select_experts


class AoERouter(MegatronModule):
    """Owns W_down of all experts, replicated on every rank: [d_model, E * d_low]."""

    def __init__(self, *, config, pg_collection=None, aoe: AoEConfig) -> None:
        super().__init__(config)
        self.aoe = aoe
        self.layer_number: Optional[int] = None
        self.weight = torch.nn.Parameter(
            torch.empty(
                aoe.d_model, aoe.num_experts * aoe.d_low,
                dtype=config.params_dtype, device=target_device(config),
            )
        )
        # Selection statistics of the last forward (for logging and analysis), never saved.
        self.register_buffer("last_aux_loss", torch.zeros(()), persistent=False)
        self.register_buffer("last_load", torch.zeros(aoe.num_experts), persistent=False)
        self.register_buffer("last_ent_conf", torch.zeros(()), persistent=False)
        self.register_buffer("last_mean_norm", torch.zeros(aoe.num_experts), persistent=False)
        self.reset_parameters()

    @property
    def w_down_DER(self) -> torch.Tensor:
        return self.weight

    def reset_parameters(self) -> None:
        seed = draw_module_seed()
        r = self.aoe.d_low
        for g in range(self.aoe.num_experts):
            expert_normal_(
                self.weight[:, g * r : (g + 1) * r], module_seed=seed, global_expert=g, slot=0,
                std=self.config.init_method_std,
            )

    def set_layer_number(self, layer_number: int) -> None:
        self.layer_number = layer_number

    def forward(self, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        """hidden_states [S, B, D] -> (probs_TE, routing_map_TE, cache_TER)."""
        x_TD = hidden_states.reshape(-1, self.aoe.d_model)
        cache_TER = ops.low_rank_cache(x_TD, w_down_DER=self.weight, num_experts=self.aoe.num_experts)
        norms_TE = ops.expert_norms(cache_TER, order=self.aoe.norm)
        sel = select_experts(norms_TE, strategy=self.aoe.weight_mode, top_k=self.aoe.top_k)
        probs_TE = sel.probs_TE
        # NOTE: as MoELayer.forward documents, padding_mask is True for *valid* tokens; padding
        # still gets experts (shapes stay static) but counts in neither L_aux nor the statistics.
        valid_T = None if padding_mask is None else padding_mask.reshape(-1).bool()
        routing_kept = sel.routing_map_TE if valid_T is None else sel.routing_map_TE[valid_T]
        scores_kept = sel.scores_TE if valid_T is None else sel.scores_TE[valid_T]
        with torch.no_grad():
            self.last_load.copy_(ops.load_fractions(routing_kept).to(self.last_load.dtype))
            self.last_ent_conf.copy_(ops.confidence_entropy(scores_kept.detach()))
            norms_kept = norms_TE if valid_T is None else norms_TE[valid_T]
            self.last_mean_norm.copy_(norms_kept.detach().float().mean(0))
        if self.aoe.alpha_aux > 0 and self.training and torch.is_grad_enabled():
            aux = ops.load_balancing_loss(
                routing_map_TE=routing_kept, scores_TE=scores_kept, alpha=self.aoe.alpha_aux
            )
            self.last_aux_loss.copy_(aux.detach())
            probs_TE = MoEAuxLossAutoScaler.apply(probs_TE, aux)
            save_to_aux_losses_tracker(
                "load_balancing_loss", aux.detach() / self.aoe.alpha_aux, self.layer_number,
                self.config.num_layers,
            )
        return probs_TE, sel.routing_map_TE, cache_TER
