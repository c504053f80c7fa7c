"""The per-layer sections of a model preset: ``aoe:`` (AoEConfig, aoe_megatron.moe.config: AoE's
own settings) and ``router:`` (RouterSettings, the traditional-MoE router's own; the router
variants' RouterConfig, aoe_megatron.models.moe_router, adds what it shares with the model)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from aoe_megatron.moe.config import AoEConfig, upgrade_legacy_keys


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
SECTIONS = {"aoe": AoEConfig, "router": RouterSettings}


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
