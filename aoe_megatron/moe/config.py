"""The AoE layer's settings: ``AoEConfig`` (AoE's own, a preset's ``aoe:`` section) and
``AoELayerConfig`` (those plus what the layer shares with its model, read from megatron-core's
``TransformerConfig`` in one step: ``AoELayerConfig.from_megatron``)."""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field, fields
from typing import Literal, Union, get_args

from aoe_megatron.moe.ops import (
    D_WIDE_ROUNDING,
    FACTORIZATIONS,
    NORM_ORDERS,
    d_wide_for_parity,
    round_to_multiple,
)
from aoe_megatron.moe.selection import BIASABLE, check_options, selection_strategies
from aoe_megatron.runtime.deprecations import deprecation, renamed

Norm = Literal["l2", "l1", "linf"]
Rounding = Literal["up", "nearest"]
RankSource = Literal["cache", "frozen_random", "router"]
Factorized = Literal["gate", "up", "none"]
GateInit = Literal["paper", "unfactorized_std"]
InferenceSelection = Literal["norm", "fon", "router"]
CacheMode = Literal["send", "recompute"]
ExpertBackend = Literal["auto", "loop", "padded", "grouped_mm", "autograd"]
Dispatcher = Literal["alltoall", "allgather"]

CACHE_MODES = get_args(CacheMode)
RANK_SOURCES = get_args(RankSource)
INFERENCE_SELECTIONS = get_args(InferenceSelection)
GATE_INITS = get_args(GateInit)
DISPATCHERS = get_args(Dispatcher)
EXPERT_BACKENDS = get_args(ExpertBackend)
# The math's own lists (moe/ops.py) and these types name the same choices.
assert get_args(Norm) == NORM_ORDERS and get_args(Factorized) == FACTORIZATIONS
assert get_args(Rounding) == D_WIDE_ROUNDING


def _choose(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"unknown AoE {name} {value!r}; choose one of {choices}.")


@dataclass(frozen=True, kw_only=True)
class AoEConfig:
    """Autonomy-of-Experts' own settings (paper arXiv 2501.13074): a model preset's ``aoe:``
    section (``ModelConfig.aoe``). What the layer shares with its model (experts, top-K, d_model,
    d_ffn, alpha_aux, the dispatcher, EP, the expert bias) is not here: ``AoELayerConfig`` adds it
    from the model's TransformerConfig."""

    d_low: int = 256
    """Width of each expert's low-rank cache C_i = x W_down^i (Eq. 3); must be below d_model
    (256: the paper's 732M model, about d_model / 3)."""
    d_wide: Union[int, Literal["auto"]] = "auto"
    """Width of W_up / W_p / W_o; "auto" derives it from the MoE expert width d_ffn by Eq. 5
    (parameter parity)."""
    d_wide_multiple: int = 1
    """d_wide "auto" is rounded to a multiple of this (1: Eq. 5 as the paper), as
    ``d_wide_round`` says. GEMMs run faster on aligned widths: at the 4B shape Eq. 5 gives 6470;
    64 rounds it up to 6528 (0.9% more parameters per expert) or to the nearest 6464 (0.08%
    fewer); ``make bench`` measures them."""
    d_wide_round: Rounding = "up"
    """How d_wide "auto" is rounded to ``d_wide_multiple``."""
    norm: Norm = "l2"
    """Norm that ranks experts: "l2" (paper), "l1" or "linf" (Appendix A)."""
    selection: str = "topk_softmax"
    """Selection strategy (aoe_megatron.moe.selection, a registry): "topk_softmax" (Algorithm 2),
    "softmax_topk" (authors' release), "top_p", "expert_choice", "random" (the review's control
    (a)). Called ``weight_mode`` before; stored settings with that key still load
    (``LEGACY_KEYS``)."""
    selection_options: dict = field(default_factory=dict)
    """Keyword options of the strategy: {"p": 0.6} for top_p, {"capacity_factor": 2.0} for
    expert_choice."""
    rank_source: RankSource = "cache"
    """What experts are ranked by: "cache" (||x W_down^i||, the paper), "frozen_random" (the
    review's control (b): ||x F^i|| for a random F that is never trained; W_down still computes
    the experts' output) or "router" (a linear router's logits: the paper's Config 3)."""
    factorized: Factorized = "gate"
    """Which projection the cache factorizes: "gate" (W_g = W_down W_up, the paper), "up" (W_p
    instead: the rebuttal's variant) or "none" (the cache is the first d_low elements of the full
    gate pre-activation x W_g^i: the rebuttal's "first n elements"; d_wide "auto" is then d_ffn)."""
    gate_init: GateInit = "paper"
    """How the factorized projection W_down W_up starts (factorized "gate" or "up"): "paper" (both
    N(0, init_method_std^2), as the authors' code: x W_down W_up then has sqrt(d_low) *
    init_method_std times the std of an unfactorized x W_g, about 8x smaller at d_low 42) or
    "unfactorized_std" (W_up ~ N(0, 1 / d_low): x W_down W_up starts with the std of x W_g for
    W_g ~ N(0, init_method_std^2), the traditional MoE expert's)."""
    inference_selection: InferenceSelection = "norm"
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
    cache_mode: CacheMode = "send"
    """"send": ship each (token, expert) pair's cache slice C_i to the expert's rank with x;
    "recompute": ship x only and recompute x W_down^i at the expert."""
    lean_cache: bool = True
    """Keep only x for the backward of the cache and its norms (x W_down is recomputed there)
    instead of the whole [T, E * d_low] cache; the dispatched rows keep the selected slices."""
    expert_backend: ExpertBackend = "auto"
    """How this rank's experts compute: "loop" (one GEMM per expert), "padded" (one batched GEMM
    over experts padded to the busiest), "grouped_mm" (``torch._grouped_mm``), "auto" (chosen by
    device, dtype and shape; see aoe_megatron.moe.grouped) or "autograd" (the plain per-expert
    autograd loop that keeps every intermediate: the reference)."""
    recompute_low_rank: bool = False
    """Also recompute C_i W_up^i in the experts' backward instead of keeping it: d_wide fewer
    values kept per dispatched row, for one extra low-rank GEMM (d_low x d_wide) per row."""

    def __post_init__(self) -> None:
        for name in ("d_low", "d_wide_multiple"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"AoE {name} must be a positive integer, got {value!r}.")
        if self.d_wide != "auto" and (not isinstance(self.d_wide, int) or isinstance(self.d_wide, bool)
                                      or self.d_wide <= 0):
            raise ValueError(f"AoE d_wide must be a positive integer or 'auto', got {self.d_wide!r}.")
        _choose("d_wide_round", self.d_wide_round, D_WIDE_ROUNDING)
        _choose("norm", self.norm, NORM_ORDERS)
        _choose("selection strategy", self.selection, selection_strategies())
        if not isinstance(self.selection_options, dict):
            raise ValueError(f"AoE selection_options must be a mapping, got {self.selection_options!r}.")
        _choose("factorized", self.factorized, FACTORIZATIONS)
        _choose("gate_init", self.gate_init, GATE_INITS)
        if self.gate_init != "paper" and self.factorized == "none":
            raise ValueError("AoE gate_init applies to a factorized projection (factorized 'gate' or "
                             "'up'); with factorized 'none' nothing is factorized.")
        _choose("inference_selection", self.inference_selection, INFERENCE_SELECTIONS)
        _choose("rank_source", self.rank_source, RANK_SOURCES)
        if self.inference_selection != "norm" and self.rank_source != "cache":
            raise ValueError("inference_selection 'fon'/'router' apply to norm-ranked AoE "
                             "(rank_source 'cache') only.")
        if not self.ent_conf_coeff >= 0 or not 0 <= self.input_jitter < 1:
            raise ValueError("AoE ent_conf_coeff must be >= 0 and input_jitter in [0, 1).")
        _choose("cache_mode", self.cache_mode, CACHE_MODES)
        _choose("expert_backend", self.expert_backend, EXPERT_BACKENDS)
        for name in ("lean_cache", "recompute_low_rank"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"AoE {name} must be true or false, got {getattr(self, name)!r}.")


@dataclass(frozen=True, kw_only=True)
class AoELayerConfig(AoEConfig):
    """What an AoE layer's modules read: AoE's own settings plus those it shares with its model,
    which megatron-core's TransformerConfig holds (``from_megatron`` reads them: the names are
    in MEGATRON_FIELD_MAP). Validated together: the checks that need both live here."""

    num_experts: int
    """n: experts per layer (``num_moe_experts``)."""
    top_k: int
    """K: experts each token continues with (``moe_router_topk``)."""
    d_model: int
    """Hidden size of the transformer (``hidden_size``)."""
    d_ffn: int | None = None
    """The traditional MoE expert width that "auto" d_wide matches by Eq. 5 (``moe_ffn_hidden_size``)."""
    alpha_aux: float = 0.01
    """Weight of the load-balancing loss of Eq. 6; 0 disables it (``moe_aux_loss_coeff``)."""
    dispatcher: Dispatcher = "alltoall"
    """Expert-parallel token dispatcher (``moe_token_dispatcher_type``)."""
    expert_parallel_size: int = 1
    """EP: ranks the experts are split over; must divide num_experts (``expert_model_parallel_size``)."""
    expert_bias: bool = False
    """Aux-loss-free balancing on the norms (``ModelConfig.expert_bias``, documented there; not in
    the TransformerConfig, whose expert bias is megatron-core's router's): the trainer moves the
    bias (``train.balance``); the weights stay a softmax over the unbiased selected norms."""
    bias_update_rate: float = 1e-3
    """How far each expert's bias moves per step (``ModelConfig.bias_update_rate``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_experts", "top_k", "d_model", "expert_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
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
        if self.d_wide == "auto" and (not isinstance(self.d_ffn, int) or self.d_ffn <= 0):
            raise ValueError(
                "AoE d_wide='auto' needs a positive d_ffn (the MoE expert width Eq. 5 matches)."
            )
        try:  # the strategy accepts its options (a two-token dry run, the RNG untouched)
            check_options(self.selection, num_experts=self.num_experts, top_k=self.top_k,
                          options=self.selection_options)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"AoE selection_options {self.selection_options} for {self.selection!r}: {exc}"
            ) from None
        if self.factorized == "none" and self.d_low >= self.resolved_d_wide:
            raise ValueError(f"factorized 'none' ranks by the first d_low={self.d_low} of "
                             f"d_wide={self.resolved_d_wide} gate elements: d_low must be smaller.")
        if not self.alpha_aux >= 0:
            raise ValueError(f"AoE alpha_aux must be >= 0, got {self.alpha_aux!r}.")
        if self.expert_bias and (self.selection not in BIASABLE or self.inference_selection != "norm"):
            raise ValueError(f"AoE expert_bias biases the top-K choice: it needs selection one of "
                             f"{BIASABLE} and inference_selection 'norm', not {self.selection!r} / "
                             f"{self.inference_selection!r}.")
        if not self.bias_update_rate >= 0:
            raise ValueError(f"bias_update_rate must be >= 0, got {self.bias_update_rate!r}.")
        _choose("dispatcher", self.dispatcher, DISPATCHERS)

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

    @property
    def settings(self) -> AoEConfig:
        """AoE's own part (what a preset's ``aoe:`` section holds)."""
        own = {f.name for f in fields(AoEConfig)}
        return AoEConfig(**{k: v for k, v in asdict(self).items() if k in own})

    @classmethod
    def from_megatron(cls, tc, aoe: AoEConfig | None = None, **shared) -> "AoELayerConfig":
        """The layer's settings in one step: the shared ones from megatron-core's TransformerConfig
        ``tc`` (MEGATRON_FIELD_MAP's names), AoE's own from ``aoe`` (the defaults when None).
        ``shared`` sets what the TransformerConfig does not hold for AoE (``expert_bias``,
        ``bias_update_rate``: the model's) or overrides one of its settings."""
        own = {f.name for f in fields(AoEConfig)}
        unknown = set(shared) - ({f.name for f in fields(cls)} - own)
        if unknown:
            raise ValueError(f"unknown shared AoE layer settings {sorted(unknown)} (AoE's own go in "
                             f"the AoEConfig: {sorted(own & set(shared))})")
        values = {ours: getattr(tc, theirs) for ours, theirs in MEGATRON_FIELD_MAP.items()}
        if values["d_ffn"] is None:
            values["d_ffn"] = tc.ffn_hidden_size
        if isinstance(values["alpha_aux"], (list, tuple)):  # one coefficient per aux loss type
            values["alpha_aux"] = values["alpha_aux"][0] if values["alpha_aux"] else 0.0
        values.update(shared)
        if values["num_experts"] is None:
            raise ValueError("the TransformerConfig has no num_moe_experts: it describes no MoE layer.")
        return cls(**values, **asdict(aoe or AoEConfig()))


#: AoELayerConfig field <- megatron TransformerConfig field: the settings an AoE layer shares with
#: its model (a preset's ModelConfig holds them; the run sets EP).
MEGATRON_FIELD_MAP = {
    "num_experts": "num_moe_experts",
    "top_k": "moe_router_topk",
    "d_model": "hidden_size",
    "d_ffn": "moe_ffn_hidden_size",
    "alpha_aux": "moe_aux_loss_coeff",
    "dispatcher": "moe_token_dispatcher_type",
    "expert_parallel_size": "expert_model_parallel_size",
}

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
