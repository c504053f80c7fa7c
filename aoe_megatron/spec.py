"""GPTModel layer specs: Llama-style (RMSNorm, RoPE, SwiGLU, no biases) with AoE or stock MoE.

The stock spec is megatron-core's own MoE layer: the paper's "traditional MoE" baseline.
TransformerEngine's fused attention and norms are used when TE and CUDA are both present.
"""

from __future__ import annotations

from functools import partial

import torch
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from aoe_megatron.compat import have_transformer_engine
from aoe_megatron.config import AoEConfig
from aoe_megatron.experts import AoEExperts
from aoe_megatron.layer import AoEMoELayer
from aoe_megatron.router import AoERouter


def use_transformer_engine() -> bool:
    """TE's fused attention and norms, when TE is installed and CUDA is present."""
    return have_transformer_engine() and torch.cuda.is_available()


def moe_layer_spec(num_experts: int, *, use_te: bool | None = None) -> ModuleSpec:
    """megatron-core's stock MoE transformer layer (the traditional-MoE baseline)."""
    from megatron.core.models.gpt import gpt_layer_specs

    if use_te is None:
        use_te = use_transformer_engine()
    if use_te:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=True
        )
    return gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=False, normalization="RMSNorm"
    )


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
