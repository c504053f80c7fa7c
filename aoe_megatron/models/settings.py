"""The per-layer sections of a model preset: ``aoe:`` (AoESettings) and ``router:`` (RouterSettings).

One schema: AoESettings is AoEConfig (aoe_megatron.moe.config) less the settings a model shares
with its layers, generated from AoEConfig's fields, so names, types, defaults and documentation
live in one place. RouterSettings is the base of the router variants' RouterConfig
(aoe_megatron.models.moe_router), which adds the shared settings the same way.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields, make_dataclass
from typing import Union  # noqa: F401  (AoEConfig's field types name it)

from aoe_megatron.moe.config import MEGATRON_FIELD_MAP, MODEL_FIELDS, AoEConfig, upgrade_legacy_keys


def _section_of(config_cls, *, shared, name: str, doc: str):
    """A frozen keyword-only dataclass with ``config_cls``'s fields, types and defaults, less
    ``shared``."""
    specs = []
    for f in fields(config_cls):
        if f.name in shared:
            continue
        if f.default is not MISSING:
            spec = field(default=f.default)
        elif f.default_factory is not MISSING:
            spec = field(default_factory=f.default_factory)
        else:
            spec = field()
        specs.append((f.name, f.type, spec))
    cls = make_dataclass(name, specs, frozen=True, kw_only=True)
    cls.__module__, cls.__qualname__, cls.__doc__ = __name__, name, doc
    return cls


AoESettings = _section_of(
    AoEConfig, shared=(*MEGATRON_FIELD_MAP, *MODEL_FIELDS), name="AoESettings",
    doc="""The AoE-only part of a model preset (its ``aoe:`` section): AoEConfig's fields with their
    names, types and defaults, less those a model shares with its layers (``MEGATRON_FIELD_MAP``:
    num_experts, top_k, d_model, d_ffn, alpha_aux and dispatcher are ModelConfig's; the run sets
    expert_parallel_size; ``MODEL_FIELDS``: expert_bias, bias_update_rate are ModelConfig's too). Each field is documented on ``aoe_megatron.moe.config.AoEConfig``;
    ``ModelConfig.aoe_config`` builds that config from a preset.""",
)


@dataclass(frozen=True, kw_only=True)
class RouterSettings:
    """The traditional-MoE router (arch "moe"); the defaults are megatron-core's own TopKRouter.
    RouterConfig (aoe_megatron.models.moe_router) is these plus the settings shared with the model."""

    gate: str = "linear"
    """"linear" (x W_g, W_g: d_model x n), "two_layer" (the paper's Config 4 "large router":
    SiLU(x W_1) W_2 with W_1: d_model x (n * hidden_per_expert)) or "hash" (Roller et al. 2021:
    no weights; a fixed random table gives each token id a bucket; with selection "hash")."""
    hidden_per_expert: int = 0
    """two_layer: W_1's width per expert; the paper's d_low, so that W_1 has n * d_low * d_model
    parameters, as many as AoE's W_down."""
    selection: str = "topk_softmax"
    """Selection strategy (aoe_megatron.moe.selection) over the router logits (as AoEConfig's;
    ``weight_mode`` before)."""
    selection_options: dict = field(default_factory=dict)
    """The strategy's options, e.g. {p: 0.6} for top_p, {capacity_factor: 2.0} for expert_choice."""
    ent_conf_coeff: float = 0.0
    """Ent_conf regularizer weight over the router's softmax (1e-4 with top-P)."""
    input_jitter: float = 0.0
    """Switch jitter on the router input (training only)."""
    score_function: str = "softmax"
    """The stock router's scores: "softmax" (the paper's MoE, Mixtral) or "sigmoid" (DeepSeek-V3;
    megatron-core's expert bias requires it: top-K of sigmoid(logits) + bias, the selected
    sigmoids renormalised to sum to 1)."""

    @property
    def is_stock(self) -> bool:
        """megatron-core's TopKRouter computes this router (the baseline uses it as is)."""
        return (self.gate == "linear" and self.selection == "topk_softmax"
                and not self.selection_options and self.ent_conf_coeff == 0 and self.input_jitter == 0)


#: A preset's ``model:`` sections and their schemas.
SECTIONS = {"aoe": AoESettings, "router": RouterSettings}


def upgrade_sections(model: dict, *, where: str = "model settings") -> dict:
    """A copy of a preset's ``model:`` dict whose ``aoe:`` and ``router:`` sections use the current
    key names (an old one warns; see moe.config.LEGACY_KEYS)."""
    out = dict(model)
    for name in SECTIONS:
        if isinstance(out.get(name), dict):
            out[name] = upgrade_legacy_keys(out[name], where=f"{where}: {name}")
    return out


def section_from_dict(name: str, raw: dict | None, *, where: str = "model settings"):
    """The ``name`` section ("aoe" or "router") from its dict, old keys renamed, unknown refused."""
    cls = SECTIONS[name]
    section = upgrade_legacy_keys(raw or {}, where=f"{where}: {name}")
    unknown = set(section) - {f.name for f in fields(cls)}
    if unknown:
        raise ValueError(f"unknown {name} settings {sorted(unknown)}")
    return cls(**section)
