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
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from aoe_megatron.moe import autograd, loss_tracker
from aoe_megatron.moe import ops
from aoe_megatron.moe.config import AoELayerConfig
from aoe_megatron.moe.seeding import draw_module_seed, expert_normal_, target_device
from aoe_megatron.moe.selection import select_experts
from aoe_megatron.moe.selection_stats import SelectionStats
from aoe_megatron.runtime.versions import refuse_mtp


def keep_float32(module, names) -> None:
    """Buffers ``names`` of ``module`` back to float32 where a bf16 cast of the model (DeepSpeed's
    bf16 engine) turned them to bf16: a bias moved by 1e-3 steps and token counts need it (as
    megatron-core's ``TopKRouter._maintain_float32_expert_bias``)."""
    for name in names:
        buf = getattr(module, name)
        if buf.dtype != torch.float32:
            buf.data = buf.data.float()


class SelectionRouter(MegatronModule):
    """Scores [T, E] -> a registered selection strategy -> (probs, routing_map), with L_aux (Eq. 6
    for AoE, Eq. 2 for MoE: the same formula), the Ent_conf regularizer, Switch jitter and the
    selection statistics since the last logged step (``selection_stats``). ``settings`` has num_experts, top_k, selection,
    selection_options, alpha_aux, ent_conf_coeff and input_jitter (an AoELayerConfig, for one)."""

    def __init__(self, config, settings) -> None:
        super().__init__(config)
        self.settings = settings
        self.layer_number: Optional[int] = None
        e = settings.num_experts
        # Selection statistics since the last logged step (running fp32 sums), never saved.
        self.selection_stats = SelectionStats(e)

    def set_layer_number(self, layer_number: int) -> None:
        self.layer_number = layer_number

    def jitter(self, x: torch.Tensor) -> torch.Tensor:
        """Switch jitter on the routing computation's input, in training (as megatron-core's
        moe_input_jitter_eps)."""
        eps = self.settings.input_jitter
        if eps > 0 and self.training:
            return x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)
        return x

    def select(self, scores_TE: torch.Tensor, padding_mask: Optional[torch.Tensor] = None, **extra):
        """(probs_TE, routing_map_TE) from the per-expert scores (AoE: norms; MoE: logits);
        ``extra`` goes to the strategy with the configured options."""
        s = self.settings
        bias_E = getattr(self, "expert_bias", None)
        if bias_E is not None:  # aux-loss-free balancing: the top-K choice only
            extra["choice_bias_E"] = bias_E
        sel = select_experts(scores_TE, strategy=s.selection, top_k=s.top_k,
                             **s.selection_options, **extra)
        probs_TE = sel.probs_TE
        # NOTE: padding_mask is True for *padding*, as GPTModel.forward documents and TopKRouter
        # reads it (MoELayer.forward's docstring says the opposite, its code does not). Padding
        # still gets experts (shapes stay static) but counts in neither L_aux nor the statistics.
        valid_T = None if padding_mask is None else ~padding_mask.reshape(-1).bool()
        routing_kept = sel.routing_map_TE if valid_T is None else sel.routing_map_TE[valid_T]
        probs_kept = sel.scores_TE if valid_T is None else sel.scores_TE[valid_T]
        if bias_E is not None and self.training and torch.is_grad_enabled():
            with torch.no_grad():  # the step's load, for the bias update (train.balance)
                self.local_tokens_per_expert += routing_kept.sum(0).to(torch.float32)
        self.selection_stats.add(routing_kept, probs_kept,
                                 scores_TE if valid_T is None else scores_TE[valid_T])
        if not (self.training and torch.is_grad_enabled()):
            return probs_TE, sel.routing_map_TE
        if s.alpha_aux > 0:
            aux = ops.load_balancing_loss(routing_map_TE=routing_kept, scores_TE=probs_kept,
                                          alpha=s.alpha_aux)
            self.selection_stats.add_aux(aux)
            probs_TE = MoEAuxLossAutoScaler.apply(probs_TE, aux)
            loss_tracker.record("load_balancing_loss", aux.detach() / s.alpha_aux,
                                       self.layer_number, self.config.num_layers)
        if s.ent_conf_coeff > 0:
            # Ent_conf regularizer (Huang et al. 2024's dynamic loss): sharpen the confidence.
            ent = (s.ent_conf_coeff * ops.confidence_entropy(probs_kept)).to(probs_TE.dtype)
            probs_TE = MoEAuxLossAutoScaler.apply(probs_TE, ent)
            loss_tracker.record("ent_conf_loss", ent.detach() / s.ent_conf_coeff,
                                       self.layer_number, self.config.num_layers)
        return probs_TE, sel.routing_map_TE


class AoERouter(SelectionRouter):
    """Owns W_down of all experts, replicated on every rank: [d_model, E * d_low].

    ``rank_source`` says what ranks the experts: "cache" (||x W_down^i||, the paper),
    "frozen_random" (||x F^i|| for a random F never trained: the review's control (b)) or
    "router" (a linear router's logits x W_r: traditional-MoE selection over AoE's experts, the
    paper's Config 3 "factorized W_g").
    """

    def __init__(self, *, config, pg_collection=None, aoe: AoELayerConfig, is_mtp_layer: bool = False) -> None:
        refuse_mtp(is_mtp_layer, "The AoE router")  # megatron-core 0.17+ passes is_mtp_layer
        super().__init__(config, aoe)
        self.aoe = aoe
        self.weight = torch.nn.Parameter(
            torch.empty(
                aoe.d_model, aoe.num_experts * aoe.d_low,
                dtype=config.params_dtype, device=target_device(config),
            )
        )
        if aoe.rank_source == "frozen_random":
            # saved with the model (a persistent buffer) so it stays fixed across restarts
            self.register_buffer("frozen_rank_DER", torch.empty_like(self.weight.data), persistent=True)
        elif aoe.rank_source == "router":
            self.gate_DE = torch.nn.Parameter(torch.empty(
                aoe.d_model, aoe.num_experts, dtype=config.params_dtype, device=target_device(config)))
        if aoe.inference_selection == "router":
            self.imitation_DE = torch.nn.Parameter(torch.empty(
                aoe.d_model, aoe.num_experts, dtype=config.params_dtype, device=target_device(config)))
        if aoe.expert_bias:  # the names megatron-core's TopKRouter gives its expert bias
            kw = dict(dtype=torch.float32, device=target_device(config))
            self.register_buffer("expert_bias", torch.zeros(aoe.num_experts, **kw), persistent=True)
            self.register_buffer("local_tokens_per_expert", torch.zeros(aoe.num_experts, **kw),
                                 persistent=False)
        self.reset_parameters()

    @property
    def bias_update_rate(self) -> float:
        return self.aoe.bias_update_rate

    @property
    def w_down_DER(self) -> torch.Tensor:
        return self.weight

    def reset_parameters(self) -> None:
        seed = draw_module_seed()
        r = self.aoe.d_low
        targets = [(self.weight, 0)]
        if self.aoe.rank_source == "frozen_random":
            targets.append((self.frozen_rank_DER, 1))
        for tensor, slot in targets:
            for g in range(self.aoe.num_experts):
                expert_normal_(
                    tensor[:, g * r : (g + 1) * r], module_seed=seed, global_expert=g, slot=slot,
                    std=self.config.init_method_std,
                )
        for name, slot in (("gate_DE", 2), ("imitation_DE", 3)):
            if hasattr(self, name):
                for g in range(self.aoe.num_experts):
                    expert_normal_(getattr(self, name)[:, g], module_seed=seed, global_expert=g,
                                   slot=slot, std=self.config.init_method_std)

    def forward(self, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        """hidden_states [S, B, D] -> (probs_TE, routing_map_TE, cache_TER)."""
        e = self.aoe.num_experts
        if self.aoe.expert_bias:
            keep_float32(self, ("expert_bias", "local_tokens_per_expert"))
        x_TD = self.jitter(hidden_states.reshape(-1, self.aoe.d_model))
        if self.aoe.rank_source == "cache" and self.aoe.lean_cache:
            # the cache is not kept for the norms' backward (recomputed there from x)
            cache_TER, scores_TE = autograd.cache_and_norms(
                x_TD, w_down_DER=self.weight, num_experts=e, order=self.aoe.norm)
        else:
            cache_TER = ops.low_rank_cache(x_TD, w_down_DER=self.weight, num_experts=e)
            scores_TE = self._rank_scores(x_TD, cache_TER)
        if self.aoe.inference_selection == "router":
            return self._with_imitation_router(x_TD, scores_TE, padding_mask) + (cache_TER,)
        probs_TE, routing_map_TE = self.select(scores_TE, padding_mask)
        return probs_TE, routing_map_TE, cache_TER

    def _rank_scores(self, x_TD: torch.Tensor, cache_TER: torch.Tensor) -> torch.Tensor:
        """What ranks the experts (``rank_source``): the cache's norms, a frozen random
        projection's norms, or a linear router's logits."""
        if self.aoe.rank_source == "frozen_random":
            rank_TER = ops.low_rank_cache(x_TD.detach(), w_down_DER=self.frozen_rank_DER,
                                          num_experts=self.aoe.num_experts)
            return ops.expert_norms(rank_TER, order=self.aoe.norm)
        if self.aoe.rank_source == "router":
            return x_TD @ self.gate_DE
        return ops.expert_norms(cache_TER, order=self.aoe.norm)

    def _with_imitation_router(self, x_TD, norms_TE, padding_mask):
        """The rebuttal's imitation router: in training, selection by the norms as usual, plus a
        linear router on *detached* inputs trained to match the (detached) softmax over the norms;
        in evaluation the router alone picks the top-K experts, weighted by a softmax over their
        norms (Algorithm 2's weights on the router's choice)."""
        logits_TE = x_TD.detach() @ self.imitation_DE
        if not self.training:
            top_idx_TK = torch.topk(logits_TE, self.aoe.top_k, dim=-1).indices
            weights_TK = torch.softmax(norms_TE.gather(-1, top_idx_TK), dim=-1)
            probs_TE = torch.zeros_like(norms_TE).scatter(-1, top_idx_TK, weights_TK)
            return probs_TE, torch.zeros_like(norms_TE, dtype=torch.bool).scatter(-1, top_idx_TK, True)
        probs_TE, routing_map_TE = self.select(norms_TE, padding_mask)
        if torch.is_grad_enabled():
            target_TE = torch.softmax(norms_TE.detach().float(), dim=-1)
            loss = -(target_TE * torch.log_softmax(logits_TE.float(), dim=-1)).sum(-1).mean()
            probs_TE = MoEAuxLossAutoScaler.apply(probs_TE, (self.aoe.imitation_coeff * loss).to(probs_TE.dtype))
            loss_tracker.record("imitation_loss", loss.detach(), self.layer_number,
                                self.config.num_layers)
        return probs_TE, routing_map_TE
