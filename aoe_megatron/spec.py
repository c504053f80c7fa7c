"""GPTModel layer specs: Llama-style (RMSNorm, RoPE, SwiGLU, no biases) with AoE or stock MoE.

The stock spec is megatron-core's own MoE layer: the paper's "traditional MoE" baseline.
TransformerEngine's fused attention and norms are used when TE and CUDA are both present.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from megatron.core import utils as mcore_utils
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from aoe_megatron.compat import have_transformer_engine
from aoe_megatron.config import AoEConfig
from aoe_megatron.experts import AoEExperts
from aoe_megatron.init import draw_module_seed, expert_normal_
from aoe_megatron.layer import AoEMoELayer
from aoe_megatron.router import AoERouter


def use_transformer_engine() -> bool:
    """TE's fused attention and norms, when TE is installed and CUDA is present."""
    return have_transformer_engine() and torch.cuda.is_available()


class EPInvariantSequentialMLP(SequentialMLP):
    """megatron-core's SequentialMLP experts, initialised per *global* expert.

    NOTE: with ``use_cpu_initialization`` megatron-core 0.16.1 gives every EP rank the same local
    experts (global expert 0 == expert 2 at EP=2), and the RNG it consumes grows with the number
    of local experts, so every later layer's weights depend on EP. Here the experts are built with
    the global RNG forked (untouched afterwards but for one seed drawn per layer), then each
    expert's weights come from a generator seeded by (that seed, global expert), as AoE's do.
    The baseline therefore starts with distinct experts, identical at every EP size.
    """

    def __init__(self, num_local_experts, config, submodules, pg_collection=None):
        seed = draw_module_seed()
        with torch.random.fork_rng(devices=[]):
            super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection)
        ep_rank = mcore_utils.get_pg_rank(self.ep_group)
        std_out = config.init_method_std / math.sqrt(2.0 * config.num_layers)
        for local, expert in enumerate(self.local_experts):
            g = ep_rank * num_local_experts + local
            expert_normal_(expert.linear_fc1.weight, module_seed=seed, global_expert=g, slot=1,
                           std=config.init_method_std)
            expert_normal_(expert.linear_fc2.weight, module_seed=seed, global_expert=g, slot=2,
                           std=std_out)


def moe_layer_spec(num_experts: int, *, use_te: bool | None = None, router=None) -> ModuleSpec:
    """megatron-core's stock MoE transformer layer (the traditional-MoE baseline); ``router`` (a
    ``moe_router.RouterConfig``) swaps megatron-core's TopKRouter for an ablation's router."""
    from megatron.core.models.gpt import gpt_layer_specs

    if use_te is None:
        use_te = use_transformer_engine()
    if router is not None:
        from aoe_megatron.moe_router import VariantRouter

        spec = moe_layer_spec(num_experts, use_te=use_te)
        spec.submodules.mlp.submodules.router = partial(VariantRouter, router=router)
        return spec
    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=True
        )
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=False, normalization="RMSNorm"
    )
    experts = spec.submodules.mlp.submodules.experts
    assert experts.module is SequentialMLP, experts
    experts.module = EPInvariantSequentialMLP
    return spec


def aoe_mlp_spec(aoe: AoEConfig) -> ModuleSpec:
    """The AoE MoE layer as an ``mlp`` submodule spec."""
    return ModuleSpec(
        module=AoEMoELayer,
        submodules=MoESubmodules(
            router=partial(AoERouter, aoe=aoe),
            experts=ModuleSpec(module=AoEExperts, params={"aoe": aoe}),
        ),
        params={"aoe": aoe},
    )


def aoe_layer_spec(aoe: AoEConfig, *, use_te: bool | None = None) -> ModuleSpec:
    """A transformer layer with attention as in the stock spec and the AoE layer as its MLP."""
    spec = moe_layer_spec(aoe.num_experts, use_te=use_te)
    spec.submodules.mlp = aoe_mlp_spec(aoe)
    return spec
