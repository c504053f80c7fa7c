"""The AoE MoE layer: megatron-core's ``MoELayer`` with the AoE router, dispatcher and experts.

Flow (megatron-core's stages, unchanged order): route (cache, norms, selection, L_aux) ->
preprocess (permute; append C_i in cache mode "send") -> dispatch (all-to-all / all-gather) ->
experts (Eq. 3) -> combine. The local path (EP=1) and the expert-parallel path run the same code.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core import utils as mcore_utils
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

from aoe_megatron.moe import ops
from aoe_megatron.moe.config import AoELayerConfig
from aoe_megatron.moe.dispatcher import AoEAllGatherTokenDispatcher, AoEAlltoAllTokenDispatcher
from aoe_megatron.moe.selection import select_experts, selects_top_k_per_token
from aoe_megatron.runtime.versions import constructor_kwargs, refuse_mtp


def _check_supported(config, aoe: AoELayerConfig, pg_collection) -> None:
    ep = mcore_utils.get_pg_size(pg_collection.ep)
    if ep != aoe.expert_parallel_size:
        raise ValueError(
            f"the AoE config says expert_parallel_size={aoe.expert_parallel_size} but the expert "
            f"parallel group has {ep} ranks; build the AoELayerConfig from the same TransformerConfig."
        )
    if mcore_utils.get_pg_size(pg_collection.expt_tp) > 1 or mcore_utils.get_pg_size(pg_collection.tp) > 1:
        raise ValueError("AoE layers support tensor parallel size 1 only (use EP and DP to scale).")
    if config.moe_expert_capacity_factor is not None:
        raise ValueError("AoE layers are dropless: unset moe_expert_capacity_factor.")
    if config.moe_permute_fusion:
        raise ValueError("AoE layers use megatron-core's unfused permute: unset moe_permute_fusion.")
    if config.moe_shared_expert_intermediate_size is not None:
        raise ValueError("AoE layers have no shared experts: unset moe_shared_expert_intermediate_size.")


class AoEMoELayer(MoELayer):
    """An MoELayer whose router is AoE's norm-based self-selection."""

    def __init__(
        self,
        config,
        submodules: Optional[MoESubmodules] = None,
        layer_number: Optional[int] = None,
        pg_collection=None,
        is_mtp_layer: bool = False,
        name: Optional[str] = None,
        *,
        aoe: AoELayerConfig,
    ):
        # NOTE: TransformerLayer passes pg_collection only to MoELayer itself, not to subclasses,
        # so fetch the defaults here (MoELayer would do the same).
        if pg_collection is None:
            pg_collection = get_default_pg_collection()
        _check_supported(config, aoe, pg_collection)
        self.aoe = aoe
        refuse_mtp(is_mtp_layer, "The AoE layer")
        super().__init__(config, submodules, layer_number, pg_collection,
                         **constructor_kwargs(name=name))
        cls = {"alltoall": AoEAlltoAllTokenDispatcher, "allgather": AoEAllGatherTokenDispatcher}
        extra = {"d_model": aoe.d_model, "num_experts": aoe.num_experts}
        self.token_dispatcher = cls[aoe.dispatcher](
            self.num_local_experts, self.local_expert_indices, config=config,
            pg_collection=pg_collection, **(extra if aoe.dispatcher == "allgather" else {}),
        )
        self.token_dispatcher.variable_count = not selects_top_k_per_token(aoe.selection)
        self._pending_cache: Optional[torch.Tensor] = None

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None,
                padding_mask: Optional[torch.Tensor] = None):
        if self.training or self.aoe.inference_selection != "fon":
            return super().forward(hidden_states, intermediate_tensors, padding_mask)
        return self.final_output_norm_forward(hidden_states), None

    def final_output_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The rebuttal's FON selection (evaluation only): every expert computes its output for
        every token, experts are ranked by the norm of that output and the configured strategy
        weights them (topk_softmax: softmax over the selected output norms). Dense, EP=1 only."""
        if self.experts.ep_size != 1:
            raise ValueError("FON selection needs every expert's output on one rank: EP=1 only")

        aoe = self.aoe
        x_TD = hidden_states.reshape(-1, aoe.d_model)
        t, e = x_TD.shape[0], aoe.num_experts
        cache_TER = ops.low_rank_cache(x_TD, w_down_DER=self.router.weight, num_experts=e)
        # every token sent to every expert, through the experts' own forward (its backend)
        rows_NX = torch.cat([x_TD.expand(e, t, aoe.d_model), cache_TER.transpose(0, 1)], dim=-1)
        y_ND, _ = self.experts(rows_NX.reshape(e * t, -1), torch.full((e,), t),
                               x_TD.new_ones(e * t, dtype=torch.float32))
        y_TED = y_ND.view(e, t, aoe.d_model).transpose(0, 1)
        sel = select_experts(ops.expert_norms(y_TED, order=aoe.norm), strategy=aoe.selection,
                             top_k=aoe.top_k, **aoe.selection_options)
        out_TD = torch.einsum("te,ted->td", sel.probs_TE.to(y_TED.dtype), y_TED)
        return out_TD.view_as(hidden_states)

    def route(self, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        probs, routing_map, cache_TER = self.router(hidden_states, padding_mask)
        # NOTE: MoELayer.forward calls route() then preprocess() with fixed signatures; the cache
        # is handed from one to the other here and consumed at once (recompute re-runs both).
        self._pending_cache = cache_TER if self.aoe.cache_mode == "send" else None
        return probs, routing_map

    def preprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        cache_TER, self._pending_cache = self._pending_cache, None
        return self.token_dispatcher.dispatch_preprocess(hidden_states, routing_map, probs, cache_TER)

    def routed_experts_compute(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        dispatched, tokens_per_expert, permuted_probs = self.token_dispatcher.dispatch_postprocess(
            hidden_states, probs
        )
        w_down = self.router.w_down_DER if self.aoe.cache_mode == "recompute" else None
        expert_output, mlp_bias = self.experts(dispatched, tokens_per_expert, permuted_probs, w_down)
        return self.token_dispatcher.combine_preprocess(expert_output), mlp_bias
