"""The AoE layer's configuration and its adapter from megatron-core's ``TransformerConfig``."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, fields, replace
from typing import Union

from aoe_megatron.moe.ops import (
    D_WIDE_ROUNDING,
    FACTORIZATIONS,
    NORM_ORDERS,
    d_wide_for_parity,
    round_to_multiple,
)
from aoe_megatron.moe.selection import BIASABLE, check_options, selection_strategies
from aoe_megatron.runtime.deprecations import deprecation, renamed

CACHE_MODES = ("send", "recompute")
RANK_SOURCES = ("cache", "frozen_random", "router")
INFERENCE_SELECTIONS = ("norm", "fon", "router")
GATE_INITS = ("paper", "unfactorized_std")
DISPATCHERS = ("alltoall", "allgather")
EXPERT_BACKENDS = ("auto", "loop", "padded", "grouped_mm", "autograd")


@dataclass(frozen=True, kw_only=True)
class AoEConfig:
    """Autonomy-of-Experts layer settings (paper arXiv 2501.13074)."""

    num_experts: int
    """n: experts per layer."""
    top_k: int
    """K: experts each token continues with."""
    d_model: int
    """Hidden size of the transformer."""
    d_low: int = 256
    """Width of each expert's low-rank cache C_i = x W_down^i (Eq. 3); must be below d_model
    (256: the paper's 732M model, about d_model / 3)."""
    d_wide: Union[int, str] = "auto"
    """Width of W_up / W_p / W_o; "auto" derives it from d_ffn by Eq. 5 (parameter parity)."""
    d_ffn: int | None = None
    """The traditional MoE expert width that "auto" d_wide matches (Eq. 5)."""
    d_wide_multiple: int = 1
    """d_wide "auto" is rounded to a multiple of this (1: Eq. 5 as the paper), as
    ``d_wide_round`` says. GEMMs run faster on aligned widths: at the 4B shape Eq. 5 gives 6470;
    64 rounds it up to 6528 (0.9% more parameters per expert) or to the nearest 6464 (0.08%
    fewer); ``make bench`` measures them."""
    d_wide_round: str = "up"
    """How d_wide "auto" is rounded to ``d_wide_multiple``: "up" or "nearest"."""
    norm: str = "l2"
    """Norm that ranks experts: "l2" (paper), "l1" or "linf" (Appendix A)."""
    selection: str = "topk_softmax"
    """Selection strategy (aoe_megatron.moe.selection): "topk_softmax" (Algorithm 2), "softmax_topk"
    (authors' release), "top_p", "expert_choice", "random" (the review's control (a)). Called
    ``weight_mode`` before; stored settings with that key still load (``LEGACY_KEYS``)."""
    selection_options: dict = field(default_factory=dict)
    """Keyword options of the strategy: {"p": 0.6} for top_p, {"capacity_factor": 2.0} for
    expert_choice."""
    rank_source: str = "cache"
    """What experts are ranked by: "cache" (||x W_down^i||, the paper), "frozen_random" (the
    review's control (b): ||x F^i|| for a random F that is never trained; W_down still computes
    the experts' output) or "router" (a linear router's logits: the paper's Config 3)."""
    factorized: str = "gate"
    """Which projection the cache factorizes: "gate" (W_g = W_down W_up, the paper), "up" (W_p
    instead: the rebuttal's variant) or "none" (the cache is the first d_low elements of the full
    gate pre-activation x W_g^i: the rebuttal's "first n elements"; d_wide "auto" is then d_ffn)."""
    gate_init: str = "paper"
    """How the factorized projection W_down W_up starts (factorized "gate" or "up"): "paper" (both
    N(0, init_method_std^2), as the authors' code: x W_down W_up then has sqrt(d_low) *
    init_method_std times the std of an unfactorized x W_g, about 8x smaller at d_low 42) or
    "unfactorized_std" (W_up ~ N(0, 1 / d_low): x W_down W_up starts with the std of x W_g for
    W_g ~ N(0, init_method_std^2), the traditional MoE expert's)."""
    inference_selection: str = "norm"
    """How experts are selected in evaluation (training always ranks by ``rank_source``):
    "norm" (as trained), "fon" (the rebuttal's final-output norms: every expert computes its
    output, ranked by its norm; EP=1 only) or "router" (the rebuttal's imitation router: a linear
    router trained on detached inputs to match the softmax over the norms, then used alone)."""
    imitation_coeff: float = 1.0
    """inference_selection "router": weight of the router's imitation loss (cross-entropy to the
    detached softmax over the norms; only the router's weight receives its gradient)."""
    ent_conf_coeff: float = 0.0
    """Weight of the Ent_conf regularizer (mean entropy of the softmax over all experts' norms;
    1e-4 with top-P, after Huang et al. 2024)."""
    input_jitter: float = 0.0
    """Switch jitter: in training, the layer input is multiplied by U(1 - eps, 1 + eps) noise."""
    alpha_aux: float = 0.01
    """Weight of the load-balancing loss of Eq. 6; 0 disables it."""
    expert_bias: bool = False
    """Aux-loss-free balancing on the norms: a per-expert bias added to the norms for the top-K
    choice only (the weights stay a softmax over the unbiased selected norms), moved by
    ``bias_update_rate`` toward balance after every optimizer step from the step's load over all
    ranks (the trainer does it: ``train.balance``). Saved with the model."""
    bias_update_rate: float = 1e-3
    """How far each expert's bias moves per step (DeepSeek-V3's gamma; megatron-core's default)."""
    cache_mode: str = "send"
    """"send": ship each (token, expert) pair's cache slice C_i to the expert's rank with x;
    "recompute": ship x only and recompute x W_down^i at the expert."""
    dispatcher: str = "alltoall"
    """Expert-parallel token dispatcher: "alltoall" or "allgather"."""
    expert_parallel_size: int = 1
    """EP: ranks the experts are split over; must divide num_experts."""
    lean_cache: bool = True
    """Keep only x for the backward of the cache and its norms (x W_down is recomputed there)
    instead of the whole [T, E * d_low] cache; the dispatched rows keep the selected slices."""
    expert_backend: str = "auto"
    """How this rank's experts compute: "loop" (one GEMM per expert), "padded" (one batched GEMM
    over experts padded to the busiest), "grouped_mm" (``torch._grouped_mm``), "auto" (chosen by
    device, dtype and shape; see aoe_megatron.moe.grouped) or "autograd" (the plain per-expert
    autograd loop that keeps every intermediate: the reference)."""
    recompute_low_rank: bool = False
    """Also recompute C_i W_up^i in the experts' backward instead of keeping it: d_wide fewer
    values kept per dispatched row, for one extra low-rank GEMM (d_low x d_wide) per row."""

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "d_model", "d_low", "expert_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"AoE {name} must be a positive integer, got {value!r}.")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"AoE top_k={self.top_k} exceeds num_experts={self.num_experts}: a token cannot "
                f"continue with more experts than the layer has."
            )
        if self.num_experts % self.expert_parallel_size:
            raise ValueError(
                f"num_experts={self.num_experts} is not divisible by expert parallel size "
                f"{self.expert_parallel_size}: every EP rank must hold the same number of experts."
            )
        if self.d_low >= self.d_model:
            raise ValueError(
                f"AoE d_low={self.d_low} must be smaller than d_model={self.d_model}: the cache is "
                f"a low-rank compression of the hidden state (the paper uses about d_model/3)."
            )
        if not isinstance(self.d_wide_multiple, int) or self.d_wide_multiple <= 0:
            raise ValueError(f"AoE d_wide_multiple must be a positive integer, got "
                             f"{self.d_wide_multiple!r}.")
        if self.d_wide_round not in D_WIDE_ROUNDING:
            raise ValueError(f"unknown AoE d_wide_round {self.d_wide_round!r}; choose one of "
                             f"{D_WIDE_ROUNDING}.")
        if self.d_wide == "auto":
            if not isinstance(self.d_ffn, int) or self.d_ffn <= 0:
                raise ValueError(
                    "AoE d_wide='auto' needs a positive d_ffn (the MoE expert width Eq. 5 matches)."
                )
        elif not isinstance(self.d_wide, int) or isinstance(self.d_wide, bool) or self.d_wide <= 0:
            raise ValueError(f"AoE d_wide must be a positive integer or 'auto', got {self.d_wide!r}.")
        if self.norm not in NORM_ORDERS:
            raise ValueError(f"unknown AoE norm {self.norm!r}; choose one of {NORM_ORDERS}.")
        if self.selection not in selection_strategies():
            raise ValueError(
                f"unknown AoE selection strategy {self.selection!r}; "
                f"choose one of {selection_strategies()}."
            )
        try:  # the strategy accepts its options (a two-token dry run, the RNG untouched)
            check_options(self.selection, num_experts=self.num_experts, top_k=self.top_k,
                          options=self.selection_options)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"AoE selection_options {self.selection_options} for {self.selection!r}: {exc}"
            ) from None
        if self.factorized not in FACTORIZATIONS:
            raise ValueError(f"unknown AoE factorized {self.factorized!r}; choose one of {FACTORIZATIONS}.")
        if self.factorized == "none" and self.d_low >= self.resolved_d_wide:
            raise ValueError(f"factorized 'none' ranks by the first d_low={self.d_low} of "
                             f"d_wide={self.resolved_d_wide} gate elements: d_low must be smaller.")
        if self.gate_init not in GATE_INITS:
            raise ValueError(f"unknown AoE gate_init {self.gate_init!r}; choose one of {GATE_INITS}.")
        if self.gate_init != "paper" and self.factorized == "none":
            raise ValueError("AoE gate_init applies to a factorized projection (factorized 'gate' or "
                             "'up'); with factorized 'none' nothing is factorized.")
        if self.inference_selection not in INFERENCE_SELECTIONS:
            raise ValueError(f"unknown AoE inference_selection {self.inference_selection!r}; "
                             f"choose one of {INFERENCE_SELECTIONS}.")
        if self.inference_selection != "norm" and self.rank_source != "cache":
            raise ValueError("inference_selection 'fon'/'router' apply to norm-ranked AoE "
                             "(rank_source 'cache') only.")
        if self.rank_source not in RANK_SOURCES:
            raise ValueError(f"unknown AoE rank_source {self.rank_source!r}; choose one of {RANK_SOURCES}.")
        if not self.ent_conf_coeff >= 0 or not 0 <= self.input_jitter < 1:
            raise ValueError("AoE ent_conf_coeff must be >= 0 and input_jitter in [0, 1).")
        if not self.alpha_aux >= 0:
            raise ValueError(f"AoE alpha_aux must be >= 0, got {self.alpha_aux!r}.")
        if self.expert_bias and (self.selection not in BIASABLE or self.inference_selection != "norm"):
            raise ValueError(f"AoE expert_bias biases the top-K choice: it needs selection one of "
                             f"{BIASABLE} and inference_selection 'norm', not {self.selection!r} / "
                             f"{self.inference_selection!r}.")
        if not self.bias_update_rate >= 0:
            raise ValueError(f"bias_update_rate must be >= 0, got {self.bias_update_rate!r}.")
        if self.cache_mode not in CACHE_MODES:
            raise ValueError(f"unknown AoE cache_mode {self.cache_mode!r}; choose one of {CACHE_MODES}.")
        if self.expert_backend not in EXPERT_BACKENDS:
            raise ValueError(f"unknown AoE expert_backend {self.expert_backend!r}; "
                             f"choose one of {EXPERT_BACKENDS}.")
        for name in ("lean_cache", "recompute_low_rank"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"AoE {name} must be true or false, got {getattr(self, name)!r}.")
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"unknown AoE dispatcher {self.dispatcher!r}; choose one of {DISPATCHERS}.")

    @property
    def resolved_d_wide(self) -> int:
        """d_wide, with "auto" resolved by Eq. 5."""
        if self.d_wide == "auto":
            if self.factorized == "none":  # W_g, W_p, W_o at full width: the MoE expert's shapes
                return self.d_ffn
            w = d_wide_for_parity(d_model=self.d_model, d_ffn=self.d_ffn, d_low=self.d_low)
            return round_to_multiple(w, multiple=self.d_wide_multiple, mode=self.d_wide_round)
        return self.d_wide

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.expert_parallel_size


#: AoEConfig field <- megatron TransformerConfig field: the settings a model shares with its MoE
#: layers (a preset's ModelConfig holds them, the training run EP). Every other AoE field is
#: AoE-only: it comes from the caller (``from_transformer_config(..., d_low=...)``) and is what a
#: preset's ``aoe:`` section holds (aoe_megatron.models.settings.AoESettings).
MEGATRON_FIELD_MAP = {
    "num_experts": "num_moe_experts",
    "top_k": "moe_router_topk",
    "d_model": "hidden_size",
    "d_ffn": "moe_ffn_hidden_size",
    "alpha_aux": "moe_aux_loss_coeff",
    "dispatcher": "moe_token_dispatcher_type",
    "expert_parallel_size": "expert_model_parallel_size",
}
#: AoEConfig fields a model preset sets for every architecture at its top level (ModelConfig's),
#: not megatron-core's: the run hands them over (``ModelConfig.aoe_config``).
MODEL_FIELDS = ("expert_bias", "bias_update_rate")
AOE_ONLY_FIELDS = tuple(f.name for f in fields(AoEConfig)
                        if f.name not in MEGATRON_FIELD_MAP and f.name not in MODEL_FIELDS)

#: Old setting name -> new one (``runtime/deprecations.py``). Stored settings (preset YAML,
#: checkpoints' and runs' recorded configs, study specs) written with the old name still load,
#: with a DeprecationWarning.
LEGACY_KEYS = renamed("key")


def upgrade_legacy_keys(settings: dict, *, where: str = "settings") -> dict:
    """A copy of ``settings`` (one flat section: AoE or router) with old keys renamed to
    LEGACY_KEYS' new ones; a one-line DeprecationWarning per old key, ValueError if a section has
    both names of one setting."""
    out = dict(settings)
    for old, new in LEGACY_KEYS.items():
        if old not in out:
            continue
        if new in out:
            raise ValueError(f"{where} sets both {old!r} and {new!r}: {old!r} is the old name of "
                             f"{new!r}; keep {new!r} only.")
        warnings.warn(f"{where}: {deprecation(old).notice()}", DeprecationWarning, stacklevel=2)
        out[new] = out.pop(old)
    return out


def from_transformer_config(tc, **aoe_fields) -> AoEConfig:
    """Build an AoEConfig from megatron's TransformerConfig plus the AoE-only fields: the one
    constructor from a model's settings (``ModelConfig.aoe_config`` comes here too).

    Shared settings come from ``tc`` (see MEGATRON_FIELD_MAP; any object with those attributes);
    ``aoe_fields`` may override them; an old key (LEGACY_KEYS) is renamed, with a warning.
    """
    aoe_fields = upgrade_legacy_keys(aoe_fields, where="AoE settings")
    unknown = set(aoe_fields) - {f.name for f in fields(AoEConfig)}
    if unknown:
        raise ValueError(f"unknown AoE settings: {sorted(unknown)}")
    values = {ours: getattr(tc, theirs) for ours, theirs in MEGATRON_FIELD_MAP.items()}
    if values["d_ffn"] is None:
        values["d_ffn"] = tc.ffn_hidden_size
    if isinstance(values["alpha_aux"], (list, tuple)):
        values["alpha_aux"] = values["alpha_aux"][0] if values["alpha_aux"] else 0.0
    if values["num_experts"] is None:
        raise ValueError("the TransformerConfig has no num_moe_experts: it describes no MoE layer.")
    values.update(aoe_fields)
    return AoEConfig(**values)


def with_overrides(cfg: AoEConfig, **changes) -> AoEConfig:
    """A copy of ``cfg`` with ``changes`` applied and validated (variants are data)."""
    return replace(cfg, **changes)
