"""GPTModel layer specs: Llama-style (RMSNorm, RoPE, SwiGLU, no biases) with AoE or stock MoE.

The stock spec is megatron-core's own MoE layer: the paper's "traditional MoE" baseline.
TransformerEngine's fused attention and norms are used when TE loads and runs on CUDA
(``compat.transformer_engine_usable``). Both specs save one checkpoint layout and start their
experts per global expert, so a run's checkpoints and initial weights do not depend on TE.
"""

from __future__ import annotations

import math
from functools import partial

from megatron.core import utils as mcore_utils
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

from aoe_megatron.models.moe_router import VariantMoELayer, VariantRouter
from aoe_megatron.runtime.compat import transformer_engine_usable
from aoe_megatron.moe.config import AoELayerConfig
from aoe_megatron.moe.experts import AoEExperts
from aoe_megatron.moe.seeding import draw_module_seed, expert_normal_, rng_untouched
from aoe_megatron.moe.layer import AoEMoELayer
from aoe_megatron.models.stock_router import PaperTopKRouter
from aoe_megatron.moe.router import AoERouter
from aoe_megatron.runtime.versions import constructor_kwargs


def use_transformer_engine() -> bool:
    """TE's fused attention and norms: only when TE imports and its kernels run on this GPU."""
    return transformer_engine_usable()


# ----------------------------------------------------------------------------- expert init


def expert_weight_pairs(experts) -> list:
    """[(fc1 weight, fc2 weight)] per local expert, for megatron-core's SequentialMLP (one MLP per
    expert) or any module whose ``linear_fc1``/``linear_fc2`` keep one ``weight{i}`` per local expert
    (TE's GroupedLinear under ``TEGroupedMLP``)."""
    if hasattr(experts, "local_experts"):
        return [(e.linear_fc1.weight, e.linear_fc2.weight) for e in experts.local_experts]
    pairs = []
    for i in range(experts.num_local_experts):
        try:
            pairs.append((getattr(experts.linear_fc1, f"weight{i}"),
                          getattr(experts.linear_fc2, f"weight{i}")))
        except AttributeError:
            raise TypeError(
                f"{type(experts).__name__} has no per-expert weight{i} on linear_fc1/linear_fc2 "
                f"({type(experts.linear_fc1).__name__}): cannot initialise its experts per global "
                f"expert (a TransformerEngine GroupedLinear keeps weight0..weight{{n-1}})"
            ) from None
    return pairs


def init_experts_per_global_expert_(experts, *, module_seed: int, ep_rank: int, config) -> None:
    """Refill every local expert's weights from a generator owned by (module seed, global expert,
    slot): fc1 (slot 1) ~ N(0, init_method_std^2), fc2 (slot 2) ~ N(0, init_method_std^2 / (2L)),
    megatron-core's init and output-layer init; global expert = ep_rank * local count + local."""
    pairs = expert_weight_pairs(experts)
    std_out = config.init_method_std / math.sqrt(2.0 * config.num_layers)
    for local, (fc1, fc2) in enumerate(pairs):
        g = ep_rank * len(pairs) + local
        expert_normal_(fc1, module_seed=module_seed, global_expert=g, slot=1, std=config.init_method_std)
        expert_normal_(fc2, module_seed=module_seed, global_expert=g, slot=2, std=std_out)


def _build_per_global_expert(module, build, config) -> None:
    """``build()`` (the megatron-core experts' own __init__) with the RNG untouched but for one
    seed drawn per layer, then every local expert's weights redrawn per global expert."""
    seed = draw_module_seed()
    with rng_untouched():
        build()
    init_experts_per_global_expert_(module, module_seed=seed, config=config,
                                    ep_rank=mcore_utils.get_pg_rank(module.ep_group))


class EPInvariantSequentialMLP(SequentialMLP):
    """megatron-core's SequentialMLP experts, initialised per *global* expert.

    NOTE: with ``use_cpu_initialization`` megatron-core 0.16.1 gives every EP rank the same local
    experts (global expert 0 == expert 2 at EP=2), and the RNG it consumes grows with the number
    of local experts, so every later layer's weights depend on EP. Here the experts are built with
    the global RNG forked (untouched afterwards but for one seed drawn per layer), then each
    expert's weights come from a generator seeded by (that seed, global expert), as AoE's do.
    The baseline therefore starts with distinct experts, identical at every EP size.
    """

    def __init__(self, num_local_experts, config, submodules, pg_collection=None, name=None):
        _build_per_global_expert(self, lambda: super(EPInvariantSequentialMLP, self).__init__(
            num_local_experts, config, submodules, pg_collection=pg_collection,
            **constructor_kwargs(name=name)), config)


class EPInvariantTEGroupedMLP(TEGroupedMLP):
    """megatron-core's TEGroupedMLP (TE GroupedLinear experts), initialised per *global* expert
    exactly as EPInvariantSequentialMLP: the same (seed, expert, slot) draws, so the TE baseline
    starts from the local baseline's weights at every EP size.

    NOTE: TEGroupedMLP lives in megatron-core's experts.py and imports without TE; only building it
    needs TE's GroupedLinear (the spec names it only when TE is usable).
    """

    def __init__(self, num_local_experts, config, submodules, pg_collection=None, name=None):
        _build_per_global_expert(self, lambda: super(EPInvariantTEGroupedMLP, self).__init__(
            num_local_experts, config, submodules, pg_collection=pg_collection,
            **constructor_kwargs(name=name)), config)


# ----------------------------------------------------------------------------- layer specs


def align_norm_keys(spec: ModuleSpec, reference: ModuleSpec) -> ModuleSpec:
    """Give ``spec``'s layers the checkpoint keys ``reference``'s layers save their norms under.

    megatron-core's local spec maps ``input_layernorm.`` and ``pre_mlp_layernorm.`` onto the keys of
    TE's fused norm-linears (``sharded_state_dict_keys_map``). Its TE spec fuses the input norm into
    ``linear_qkv`` (already that key) but keeps a separate ``pre_mlp_layernorm`` for MoE layers,
    unmapped: each norm that is a module of its own in ``spec`` gets the reference's entry.
    """
    own = spec.submodules.sharded_state_dict_keys_map
    extra = {old: new for old, new in reference.submodules.sharded_state_dict_keys_map.items()
             if old not in own and getattr(spec.submodules, old.rstrip("."), IdentityOp) is not IdentityOp}
    spec.submodules.sharded_state_dict_keys_map = {**own, **extra}
    return spec


def _local_spec(num_experts: int) -> ModuleSpec:
    from megatron.core.models.gpt import gpt_layer_specs

    return gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=False, normalization="RMSNorm"
    )


def moe_submodules(spec: ModuleSpec) -> MoESubmodules:
    """The MoE layer's submodules in a layer spec: its ``mlp`` is a ModuleSpec in megatron-core
    0.16.1 and a ``functools.partial(MoELayer, submodules=...)`` from 0.17 on."""
    mlp = spec.submodules.mlp
    return mlp.keywords["submodules"] if isinstance(mlp, partial) else mlp.submodules


def _builds(builder) -> type:
    """The class a spec entry builds (a ModuleSpec's module, a partial's function, or a class)."""
    if isinstance(builder, ModuleSpec):
        return builder.module
    return builder.func if isinstance(builder, partial) else builder


def build(builder, *args, **kwargs):
    """Build one entry of a spec: a ModuleSpec through megatron-core's ``build_module``, a class or
    a ``functools.partial`` (megatron-core 0.17+'s builders) by calling it."""
    if isinstance(builder, ModuleSpec):
        from megatron.core.transformer.spec_utils import build_module

        return build_module(builder, *args, **kwargs)
    return builder(*args, **kwargs)


def _swap_experts(spec: ModuleSpec, stock: type, ours: type) -> None:
    submodules = moe_submodules(spec)
    experts = submodules.experts
    if _builds(experts) is not stock:
        hint = (" (a TransformerEngine without GroupedLinear, older than 1.9?): upgrade TE or run "
                "without it" if stock is TEGroupedMLP else "")
        raise RuntimeError(
            f"megatron-core's spec gives {_builds(experts).__name__} experts where {stock.__name__} "
            f"was expected, so the baseline's experts would not be initialised per global expert{hint}"
        )
    if isinstance(experts, partial):
        submodules.experts = partial(ours, *experts.args, **experts.keywords)
    else:
        experts.module = ours


def moe_layer_spec(num_experts: int, *, use_te: bool | None = None, router=None) -> ModuleSpec:
    """megatron-core's stock MoE transformer layer (the traditional-MoE baseline), its TopKRouter's
    L_aux made the paper's Eq. 2 (``stock_router.PaperTopKRouter``); ``router`` (a
    ``moe_router.RouterConfig``) swaps that router for an ablation's."""
    from megatron.core.models.gpt import gpt_layer_specs

    if use_te is None:
        use_te = use_transformer_engine()
    if router is not None:
        spec = moe_layer_spec(num_experts, use_te=use_te)
        submodules = moe_submodules(spec)
        submodules.router = partial(VariantRouter, router=router)
        spec.submodules.mlp = ModuleSpec(module=VariantMoELayer, submodules=submodules,
                                         params={"router": router})
        return spec
    if use_te:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=True
        )
        _swap_experts(spec, TEGroupedMLP, EPInvariantTEGroupedMLP)
        spec = align_norm_keys(spec, _local_spec(num_experts))
    else:
        spec = _local_spec(num_experts)
        _swap_experts(spec, SequentialMLP, EPInvariantSequentialMLP)
    moe_submodules(spec).router = PaperTopKRouter  # Eq. 2's L_aux (stock_router.py)
    return spec


def aoe_mlp_spec(aoe: AoELayerConfig) -> ModuleSpec:
    """The AoE MoE layer as an ``mlp`` submodule spec."""
    return ModuleSpec(
        module=AoEMoELayer,
        submodules=MoESubmodules(
            router=partial(AoERouter, aoe=aoe),
            experts=ModuleSpec(module=AoEExperts, params={"aoe": aoe}),
        ),
        params={"aoe": aoe},
    )


def aoe_layer_spec(aoe: AoELayerConfig, *, use_te: bool | None = None) -> ModuleSpec:
    """A transformer layer with attention as in the stock spec and the AoE layer as its MLP."""
    spec = moe_layer_spec(aoe.num_experts, use_te=use_te)
    spec.submodules.mlp = aoe_mlp_spec(aoe)
    return spec
