"""Routers for the traditional-MoE variants of the paper's ablations (stock megatron-core experts).

``VariantRouter`` replaces megatron-core's ``TopKRouter`` in an ``MoELayer`` when a preset asks
for something that router lacks: a registered selection strategy other than top-K ("top_p",
"expert_choice", "random"), the Ent_conf regularizer, or the paper's Config 4 large router
(d_model -> n * d_low -> n). With the linear gate and "topk_softmax" it computes what TopKRouter
computes (top-K of the logits, softmax over them), which the tests check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

from aoe_megatron.models.settings import RouterSettings
from aoe_megatron.moe.seeding import draw_module_seed, expert_normal_, target_device
from aoe_megatron.moe.router import SelectionRouter
from aoe_megatron.moe.dispatcher import PairCountingAlltoAllTokenDispatcher
from aoe_megatron.moe.selection import check_options, selection_strategies, selects_top_k_per_token
from aoe_megatron.runtime.versions import constructor_kwargs, refuse_mtp

GATES = ("linear", "two_layer", "hash")


@dataclass(frozen=True, kw_only=True)
class RouterConfig(RouterSettings):
    """A traditional-MoE router: a preset's ``router:`` section (RouterSettings: the gate and its
    selection, documented there) plus the settings it shares with the model (as AoELayerConfig's)."""

    num_experts: int
    top_k: int
    d_model: int
    vocab_size: int = 0
    """hash: the token-id -> bucket table's size."""
    alpha_aux: float = 0.01

    def __post_init__(self) -> None:
        if self.gate not in GATES:
            raise ValueError(f"unknown router gate {self.gate!r}; choose one of {GATES}")
        if self.gate == "two_layer" and self.hidden_per_expert <= 0:
            raise ValueError("the two_layer router needs hidden_per_expert > 0 (the paper: d_low)")
        if (self.gate == "hash") != (self.selection == "hash"):
            raise ValueError("the hash gate and the hash strategy go together (gate: hash, "
                             "selection: hash)")
        if self.gate == "hash" and (self.vocab_size <= 0 or self.alpha_aux or self.ent_conf_coeff):
            raise ValueError("the hash router needs vocab_size, and has nothing for alpha_aux or "
                             "ent_conf_coeff to train: set them to 0")
        if self.selection not in selection_strategies():
            raise ValueError(f"unknown selection strategy {self.selection!r}; "
                             f"choose one of {selection_strategies()}")
        try:
            check_options(self.selection, num_experts=self.num_experts, top_k=self.top_k,
                          options=self.selection_options)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"selection_options {self.selection_options}: {exc}") from None
        if not (self.alpha_aux >= 0 and self.ent_conf_coeff >= 0 and 0 <= self.input_jitter < 1):
            raise ValueError("alpha_aux and ent_conf_coeff must be >= 0, input_jitter in [0, 1)")


class VariantRouter(SelectionRouter):
    """A replicated gate producing logits [T, E], then a registered selection strategy."""

    def __init__(self, *, config, pg_collection=None, router: RouterConfig,
                 is_mtp_layer: bool = False) -> None:
        refuse_mtp(is_mtp_layer, "An ablation's router")  # megatron-core 0.17+ passes it
        super().__init__(config, router)
        self.router_config = router
        dev, dtype = target_device(config), config.params_dtype
        d, e = router.d_model, router.num_experts
        self.token_ids: Optional[torch.Tensor] = None  # hash: set per batch by the model's hook
        if router.gate == "linear":
            # megatron-core's TopKRouter layout and name: weight [E, D]
            self.weight = torch.nn.Parameter(torch.empty(e, d, dtype=dtype, device=dev))
        elif router.gate == "hash":
            # A balanced random table (each bucket gets V/E token ids), saved with the model.
            self.register_buffer("bucket_of_token", torch.empty(router.vocab_size, dtype=torch.long,
                                                                device=dev), persistent=True)
        else:
            h = e * router.hidden_per_expert
            self.w1 = torch.nn.Parameter(torch.empty(h, d, dtype=dtype, device=dev))
            self.w2 = torch.nn.Parameter(torch.empty(e, h, dtype=dtype, device=dev))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        seed = draw_module_seed()  # the one draw of the global RNG (moe.seeding)
        r = self.router_config
        if r.gate == "hash":
            table = torch.randperm(r.vocab_size, generator=torch.Generator().manual_seed(seed))
            self.bucket_of_token.copy_(table % r.num_experts)
        std = self.config.init_method_std
        for slot, p in enumerate(self.parameters()):
            expert_normal_(p.data, module_seed=seed, global_expert=0, slot=slot, std=std)

    def logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        if self.router_config.gate == "linear":
            return x_TD @ self.weight.t()
        return torch.nn.functional.silu(x_TD @ self.w1.t()) @ self.w2.t()

    def forward(self, hidden_states: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        x_TD = self.jitter(hidden_states.reshape(-1, self.router_config.d_model))
        if self.router_config.gate != "hash":
            return self.select(self.logits(x_TD), padding_mask)
        if self.token_ids is None or self.token_ids.numel() != x_TD.shape[0]:
            raise RuntimeError("the hash router needs the batch's token ids: build the model with "
                               "aoe_megatron.models.gpt.build_gpt_model (its hook hands them over)")
        scores_TE = x_TD.new_zeros(x_TD.shape[0], self.router_config.num_experts)
        return self.select(scores_TE, padding_mask, buckets_T=self.bucket_of_token[self.token_ids])


def hand_token_ids_to_hash_routers(model) -> None:
    """A forward pre-hook on a GPTModel: each hash router gets the batch's token ids, in the
    [S, B] order of the hidden states its layer sees."""
    routers = [m for m in model.modules() if isinstance(m, VariantRouter) and m.router_config.gate == "hash"]
    if not routers:
        return

    def hook(module, args, kwargs):
        input_ids = args[0] if args else kwargs["input_ids"]
        ids_T = input_ids.t().reshape(-1)
        for router in routers:
            router.token_ids = ids_T

    model.register_forward_pre_hook(hook, with_kwargs=True)


class VariantMoELayer(MoELayer):
    """megatron-core's MoELayer around a ``VariantRouter``: its all-to-all dispatcher counts the
    (token, expert) pairs where the selection gives a token any number of experts (top-p,
    expert choice: ``dispatcher.PairCountingAlltoAllTokenDispatcher`` says why)."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None,
                 is_mtp_layer: bool = False, name=None, *, router: RouterConfig):
        if pg_collection is None:  # megatron-core 0.16.1 passes it to MoELayer itself only
            pg_collection = get_default_pg_collection()
        super().__init__(config, submodules, layer_number, pg_collection,
                         **constructor_kwargs(is_mtp_layer=is_mtp_layer, name=name))
        if config.moe_token_dispatcher_type == "alltoall" and not selects_top_k_per_token(router.selection):
            self.token_dispatcher = PairCountingAlltoAllTokenDispatcher(
                self.num_local_experts, self.local_expert_indices, config=config,
                pg_collection=pg_collection)
            self.token_dispatcher.variable_count = True
