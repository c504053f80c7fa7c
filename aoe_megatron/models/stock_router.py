"""The traditional-MoE baseline's router: megatron-core's TopKRouter, with the paper's L_aux.

megatron-core's switch loss (``moe_utils.switch_load_balancing_loss_func``) is
``coeff * E * sum_i f_i P_i`` with ``f_i`` the fraction of the batch's T * K assignments that go to
expert i (the fractions sum to 1). The paper's Eq. 2 (and Eq. 6 for AoE, which our
``SelectionRouter`` computes) counts ``f_i`` per token, tokens of i over T: the fractions sum to
K. Left as is, the stock baseline would train at alpha_aux / K, half the paper's alpha at top-2,
and the MoE presets would not be comparable with the variant routers' or AoE's. ``PaperTopKRouter``
hands megatron-core's own loss the coefficient ``alpha_aux * K``, which is Eq. 2 at alpha_aux,
and logs ``loss / alpha_aux`` as ``SelectionRouter`` does. Its weight is drawn, N(0,
init_method_std^2) as megatron-core draws it, from one seed of the global RNG, as every AoE and
variant module does (``moe.seeding``): upstream draws E x D values from the global stream, which
would shift every later layer's weights away from AoE's at the same seed. Everything else is
TopKRouter's.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.router import TopKRouter

from aoe_megatron.moe.router import keep_float32
from aoe_megatron.moe.seeding import draw_module_seed, expert_normal_, rng_untouched, target_device
from aoe_megatron.runtime.versions import constructor_kwargs

LOAD_BALANCING = "aux_loss"  # megatron-core's name for the switch loss (Eq. 2's form)


class PaperTopKRouter(TopKRouter):
    """TopKRouter whose ``aux_loss`` is the paper's Eq. 2 at ``moe_aux_loss_coeff`` (alpha_aux).

    With ``moe_router_enable_expert_bias`` its ``expert_bias`` and ``local_tokens_per_expert`` live
    where its weight does (megatron-core 0.16.1 allocates them on ``torch.cuda.current_device()``,
    which fails without CUDA); megatron-core updates the bias in its ``finalize_model_grads``, which
    our DeepSpeed loop does not call: ``train.balance`` does it, for this router and AoE's alike.
    """

    def __init__(self, config, pg_collection=None, is_mtp_layer: bool = False) -> None:
        biased = config.moe_router_enable_expert_bias
        config.moe_router_enable_expert_bias = False  # upstream's CUDA buffers: made below instead
        try:
            super().__init__(config=config, pg_collection=pg_collection,
                             **constructor_kwargs(is_mtp_layer=is_mtp_layer))
        finally:
            config.moe_router_enable_expert_bias = biased
        if biased:
            self.enable_expert_bias = True
            dev, e = target_device(config), config.num_moe_experts
            del self.local_tokens_per_expert, self.expert_bias  # upstream's None attributes
            self.register_buffer("local_tokens_per_expert",
                                 torch.zeros(e, dtype=torch.float32, device=dev), persistent=False)
            self.register_buffer("expert_bias", torch.zeros(e, dtype=torch.float32, device=dev))

    def _maintain_float32_expert_bias(self) -> None:
        if self.enable_expert_bias:  # the token counts too (upstream keeps the bias only)
            keep_float32(self, ("expert_bias", "local_tokens_per_expert"))

    @property
    def bias_update_rate(self) -> float:
        return self.config.moe_router_bias_update_rate

    def _apply_expert_bias(self, routing_map: torch.Tensor, padding_mask=None) -> None:
        """Counts the training forward's tokens per expert for the bias update, as upstream (whose
        version is wrapped in ``torch.compile``: a C++ build on the CPU); padding (True in
        ``padding_mask``, as the rest of TopKRouter's routing reads it) is not counted."""
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask.reshape(-1, 1)
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    def reset_parameters(self) -> None:
        seed = draw_module_seed()
        with rng_untouched():
            super().reset_parameters()
        if self.config.perform_initialization:
            expert_normal_(self.weight.data, module_seed=seed, global_expert=0, slot=0,
                           std=self.config.init_method_std)

    def get_aux_loss_coeff(self, aux_loss_type: str) -> float:
        coeff = super().get_aux_loss_coeff(aux_loss_type)
        return coeff * self.topk if aux_loss_type == LOAD_BALANCING else coeff

    def attach_and_log_load_balancing_loss(self, activation, aux_loss_coeff, aux_loss,
                                           aux_loss_name, *args, **kwargs):
        if aux_loss_name == "load_balancing_loss":  # logged as aux / alpha_aux (Eq. 2's sum)
            aux_loss_coeff = aux_loss_coeff / self.topk
        return super().attach_and_log_load_balancing_loss(activation, aux_loss_coeff, aux_loss,
                                                          aux_loss_name, *args, **kwargs)
