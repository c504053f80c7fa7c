"""The layer benchmark's shapes and arms, and how each is built (megatron-core's MoE layer as its
GPT layer spec builds it, its grouped-GEMM experts in ``mcore_grouped.py``, the AoE layer with an
arm's settings) and trained for one step.

Shape suffixes: T tokens, D d_model, E experts, K top-k, R d_low, W d_wide, F d_ffn.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from aoe_megatron.bench import flops as fl
from aoe_megatron.bench.mcore_grouped import unavailable_reason
from aoe_megatron.bench.names import ARM_FIELDS
from aoe_megatron.moe import loss_tracker
from aoe_megatron.moe.config import AoEConfig, AoELayerConfig
from aoe_megatron.moe.grouped import grouped_mm_supports
from aoe_megatron.moe.ops import d_wide_for_parity, round_to_multiple


@dataclass(frozen=True)
class LayerShape:
    d_model: int
    num_experts: int
    top_k: int
    d_ffn: int
    d_low: int
    tokens: int = 4096

    @property
    def d_wide(self) -> int:
        return d_wide_for_parity(d_model=self.d_model, d_ffn=self.d_ffn, d_low=self.d_low)


SHAPES = {
    "732m": LayerShape(d_model=768, num_experts=8, top_k=2, d_ffn=3072, d_low=256),
    "4b": LayerShape(d_model=1280, num_experts=8, top_k=2, d_ffn=5120, d_low=400),
    # d_ffn 1/8 of the dense 3072; d_low 64 is the smallest the paper trains (at 64 experts the
    # cache E * R would otherwise dominate the FLOPs).
    "fine64": LayerShape(d_model=768, num_experts=64, top_k=8, d_ffn=384, d_low=64),
}


def per_rank(shape: LayerShape, *, ep: int) -> LayerShape:
    """The block as one rank of an EP=``ep`` job computes it, its all-to-all left out: the rank's
    E / ep local experts receive the T K rows that balanced routing sends them (T tokens on every
    rank, each to K experts). Built as a layer with num_experts E / ep and top_k min(K, E / ep),
    fed T K / top_k tokens: every arm's experts get T K rows.

    NOTE: what it leaves out besides the all-to-all: routing the rank's own T tokens over all E
    experts. For MoE that is the [T, D] x [D, E] router, a fraction of a percent of the block.
    For AoE it is the cache x W_down for all E experts (T D E R multiply-adds), of which the
    per-rank layer computes only T K D R (the cache of the rows it receives, what cache mode
    "recompute" computes at the expert): (E - K) T D R left out, 9.7 GFLOP forward at the 732M
    shape, 7.7% of the AoE forward FLOPs a rank runs (7.2% at 4B). AoE's time ratios here are
    kinder to AoE by up to that much; its FLOP ratio (about 1.000) is the layer's as built.
    """
    local = shape.num_experts // ep
    if local * ep != shape.num_experts:
        raise ValueError(f"{shape.num_experts} experts do not split over EP={ep}")
    top_k = min(shape.top_k, local)
    return replace(shape, num_experts=local, top_k=top_k, tokens=shape.tokens * shape.top_k // top_k)


# The EP=8 per-rank layouts (one local expert, T K = 8192 rows): run only when named (--shapes).
SHAPES.update({f"{name}-ep8": per_rank(SHAPES[name], ep=8) for name in ("732m", "4b")})
NAMED_ONLY_SHAPES = ("732m-ep8", "4b-ep8", "tiny8-ep8")
QUICK_SHAPES = {
    "tiny8": LayerShape(d_model=64, num_experts=8, top_k=2, d_ffn=128, d_low=16, tokens=256),
    "tiny64": LayerShape(d_model=64, num_experts=64, top_k=8, d_ffn=32, d_low=8, tokens=256),
}
QUICK_SHAPES["tiny8-ep8"] = per_rank(QUICK_SHAPES["tiny8"], ep=8)


def layer_transformer_config(shape: LayerShape, *, dtype: torch.dtype, device: str, use_te: bool,
                             recompute_modules: list[str] | None = None, ep: int = 1):
    from megatron.core.transformer.transformer_config import TransformerConfig

    # megatron-core refuses top-1 routing without it (per_rank's one-expert layers); with one
    # expert the prob is 1 either way
    extra = {"moe_router_pre_softmax": True} if shape.top_k == 1 else {}
    if recompute_modules:
        extra.update(recompute_granularity="selective", recompute_modules=list(recompute_modules))
    return TransformerConfig(
        num_layers=2, hidden_size=shape.d_model, num_attention_heads=8,
        ffn_hidden_size=shape.d_ffn, moe_ffn_hidden_size=shape.d_ffn,
        num_moe_experts=shape.num_experts, moe_router_topk=shape.top_k,
        expert_model_parallel_size=ep, moe_token_dispatcher_type="alltoall",
        moe_aux_loss_coeff=0.01, use_cpu_initialization=device == "cpu", params_dtype=dtype,
        bf16=dtype == torch.bfloat16, add_bias_linear=False, gated_linear_unit=True,
        activation_func=F.silu, normalization="RMSNorm", moe_grouped_gemm=use_te, **extra,
    )


def build_moe(tc, *, device: str, use_te: bool):
    """megatron-core's own MoE layer, as its GPT layer spec builds it."""
    from aoe_megatron.models.spec import (  # deferred: megatron-core loads at build
        build, moe_layer_spec)

    spec = moe_layer_spec(tc.num_moe_experts, use_te=use_te)
    return build(spec.submodules.mlp, config=tc, layer_number=1).to(device)


def build_aoe(tc, shape: LayerShape, *, device: str, **aoe_fields):
    from megatron.core.transformer.spec_utils import build_module

    from aoe_megatron.models.spec import aoe_mlp_spec  # deferred: megatron-core loads at build

    aoe = AoELayerConfig.from_megatron(tc, AoEConfig(d_low=shape.d_low, **aoe_fields))
    layer = build_module(aoe_mlp_spec(aoe), config=tc, layer_number=1)
    return layer.to(device=device, dtype=tc.params_dtype)


def forward_backward(layer, x, g) -> None:
    for p in layer.parameters():
        p.grad = None
    x.grad = None
    out, _ = layer(x)
    (out * g).sum().backward()
    loss_tracker.clear()


def arm_d_wide(shape: LayerShape, arm: str) -> int:
    """The arm's d_wide: Eq. 5, rounded to the arm's d_wide_multiple as its d_wide_round says
    (the rounding AoEConfig applies; ``layer._build_arms`` checks the built layer against it)."""
    fields = ARM_FIELDS[arm] or {}
    return round_to_multiple(shape.d_wide, multiple=fields.get("d_wide_multiple", 1),
                             mode=fields.get("d_wide_round", "up"))


def expert_params(shape: LayerShape, arm: str) -> int:
    """Parameters of one expert: MoE's SwiGLU 3 D F; AoE's (factorization "gate") W_down^i D R,
    W_up^i R W, W_p^i and W_o^i 2 D W, at the arm's own d_wide."""
    d, r = shape.d_model, shape.d_low
    if ARM_FIELDS[arm] is None:
        return 3 * d * shape.d_ffn
    w = arm_d_wide(shape, arm)
    return d * r + r * w + 2 * d * w


def arm_skips(shape: LayerShape, *, device: str, dtype: torch.dtype,
              use_te: bool = False) -> dict[str, str]:
    """The arms that do not apply at a shape, each with why: grouped_mm where torch._grouped_mm
    cannot run it, moe-grouped where megatron-core's grouped-GEMM experts cannot run
    (``mcore_grouped.unavailable_reason``), a rounded d_wide where rounding leaves Eq. 5's
    d_wide as it is."""
    skips = {}
    why = unavailable_reason(d_model=shape.d_model, d_ffn=shape.d_ffn, device=device, dtype=dtype,
                             use_te=use_te)
    if why:
        skips["moe-grouped"] = why
    widths = (shape.d_model, shape.d_low, shape.d_wide)
    if not grouped_mm_supports(dtype, widths, torch.device(device)):
        skips["aoe-grouped_mm"] = (f"torch._grouped_mm cannot run {dtype} widths {widths} "
                                   f"on {device}")
    for arm, fields in ARM_FIELDS.items():
        multiple = (fields or {}).get("d_wide_multiple")
        if multiple and arm_d_wide(shape, arm) == shape.d_wide:
            skips[arm] = f"Eq. 5's d_wide {shape.d_wide} is a multiple of {multiple} already"
    return skips


def arms_for(shape: LayerShape, *, device: str, dtype: torch.dtype,
             wanted: list[str] | None = None, use_te: bool = False) -> list[str]:
    """The arms measured at a shape: ``wanted`` (default all, in ARM_FIELDS order) less the ones
    ``arm_skips`` drops there."""
    skips = arm_skips(shape, device=device, dtype=dtype, use_te=use_te)
    return [a for a in ARM_FIELDS if (wanted is None or a in wanted) and a not in skips]


def shape_flops(shape: LayerShape, arms: list[str]) -> dict:
    """Model and hardware FLOPs of one block's training step for each arm."""
    dims = dict(tokens=shape.tokens, d_model=shape.d_model, num_experts=shape.num_experts,
                top_k=shape.top_k)
    aoe_fwd = fl.aoe_block_forward_flops(**dims, d_low=shape.d_low, d_wide=shape.d_wide)
    moe_fwd = fl.moe_block_forward_flops(**dims, d_ffn=shape.d_ffn)
    extra = {opt: fl.recompute_extra_flops(opt, **dims, d_low=shape.d_low, d_wide=shape.d_wide,
                                           d_ffn=shape.d_ffn, arch="aoe")
             for opt in ("moe_layer", "lean_cache", "low_rank")}
    model, hardware = {}, {}
    for arm in arms:
        fields = ARM_FIELDS[arm]
        if fields is None:
            model[arm] = hardware[arm] = fl.training_flops(moe_fwd)
            continue
        model[arm] = fl.training_flops(fl.aoe_block_forward_flops(
            **dims, d_low=shape.d_low, d_wide=arm_d_wide(shape, arm)))
        hardware[arm] = model[arm] + (extra["lean_cache"] if fields.get("lean_cache", True) else 0)
    return {
        "moe_forward": moe_fwd, "aoe_forward": aoe_fwd, "ratio": aoe_fwd / moe_fwd,
        "model": model, "hardware": hardware,
        "recompute_extra_aoe": extra,
        "recompute_extra_moe": {"moe_layer": moe_fwd, "moe_act": 0},
    }
