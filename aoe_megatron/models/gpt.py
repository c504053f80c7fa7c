"""Model configuration (one schema for every preset) and the GPTModel builder."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Optional

import torch

from aoe_megatron.models.settings import (  # noqa: F401  (RouterSettings: its home)
    SECTIONS,
    RouterSettings,
    section_from_dict,
    upgrade_sections,
)
from aoe_megatron.moe.config import AoEConfig, AoELayerConfig
from aoe_megatron.runtime import resources
from aoe_megatron.runtime.compat import fused_softmax_available
from aoe_megatron.runtime.deprecations import upgrade_keys

ARCHS = ("aoe", "moe")
SCORE_FUNCTIONS = ("softmax", "sigmoid")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A Llama-style MoE language model: RMSNorm, RoPE, SwiGLU experts, no biases."""

    arch: str = "aoe"
    """"aoe" (Autonomy-of-Experts) or "moe" (megatron-core's traditional MoE with a router)."""
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    """d_ffn of a traditional MoE expert (AoE derives d_wide from it when d_wide is "auto")."""
    num_experts: int
    top_k: int
    vocab_size: int = 32000
    seq_length: int = 2048
    """Tokens per sequence. RoPE has no parameters, so it does not change the counts."""
    tie_embeddings: bool = True
    """Input embedding and output layer share one matrix (what the paper's 732M total needs)."""
    alpha_aux: float = 0.01
    """Load-balancing loss weight (Eq. 2 for MoE, Eq. 6 for AoE); 0 disables it."""
    expert_bias: bool = False
    """Aux-loss-free load balancing (DeepSeek-V3; Wang et al. 2024): a per-expert bias added to the
    selection scores for the top-K choice only, moved by ``bias_update_rate`` toward balance after
    every optimizer step from the step's load over all ranks (in the step's one collective), and
    saved with the model. arch "moe": megatron-core's expert bias, which requires
    ``router.score_function: sigmoid``; arch "aoe": a bias on the experts' norms, the weights
    staying a softmax over the unbiased selected norms. Usually with alpha_aux 0."""
    bias_update_rate: float = 1e-3
    """How far each expert's bias moves per step (DeepSeek-V3's gamma; megatron-core's default)."""
    dispatcher: str = "alltoall"
    aoe: AoEConfig = field(default_factory=AoEConfig)
    """arch "aoe" only: AoE's own settings (the layer's shared ones are the fields above)."""
    router: RouterSettings = field(default_factory=RouterSettings)
    """arch "moe" only: the router variant (the default is megatron-core's TopKRouter)."""

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"unknown arch {self.arch!r}; choose one of {ARCHS}.")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                     "num_experts", "top_k", "vocab_size", "seq_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model {name} must be a positive integer, got {value!r}.")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}."
            )
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}.")
        if self.arch == "aoe":
            self.aoe_config()  # validates the AoE settings
            if self.router != RouterSettings():
                raise ValueError("router settings apply to arch 'moe' only (AoE has no router; "
                                 "see aoe.rank_source)")
        elif not self.router.is_stock:
            self.router_config()  # validates the router variant
        if self.arch == "moe" and self.router.score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"unknown router score_function {self.router.score_function!r}; "
                             f"choose one of {SCORE_FUNCTIONS}")
        if self.arch == "moe" and (self.expert_bias or self.router.score_function != "softmax"):
            if not self.router.is_stock:
                raise ValueError("expert_bias and router.score_function apply to megatron-core's "
                                 "TopKRouter (router settings at their defaults otherwise)")
            if self.expert_bias and self.router.score_function != "sigmoid":
                raise ValueError("MoE expert_bias needs router.score_function: sigmoid "
                                 "(megatron-core 0.16.1 supports its expert bias with sigmoid "
                                 "scores only)")

    def router_config(self):
        """The traditional-MoE router variant (aoe_megatron.models.moe_router.RouterConfig)."""
        from aoe_megatron.models.moe_router import (  # deferred: megatron-core loads at build
            RouterConfig)

        return RouterConfig(num_experts=self.num_experts, top_k=self.top_k, d_model=self.hidden_size,
                            alpha_aux=self.alpha_aux, vocab_size=self.vocab_size, **asdict(self.router))

    def aoe_config(self, expert_parallel_size: int = 1, *, tc=None) -> AoELayerConfig:
        """The AoE layers' settings (build_gpt_model uses it): from ``tc``, the megatron
        TransformerConfig the model is built with, when given (its expert_model_parallel_size,
        not ``expert_parallel_size``), else from this config directly; AoE's own are ``self.aoe``."""
        bias = dict(expert_bias=self.expert_bias, bias_update_rate=self.bias_update_rate)
        if tc is not None:
            return AoELayerConfig.from_megatron(tc, self.aoe, **bias)
        return AoELayerConfig(
            **asdict(self.aoe), **bias, num_experts=self.num_experts, top_k=self.top_k,
            d_model=self.hidden_size, d_ffn=self.ffn_hidden_size, alpha_aux=self.alpha_aux,
            dispatcher=self.dispatcher, expert_parallel_size=expert_parallel_size)

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        raw = dict(raw)
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"unknown model settings {sorted(unknown)}; known: {sorted(known)}")
        sections = {name: section_from_dict(name, raw.pop(name, None)) for name in SECTIONS}
        return cls(**sections, **raw)

    def with_overrides(self, **changes) -> "ModelConfig":
        raw = asdict(self)
        changes = upgrade_sections(changes, where="model overrides")
        nested = {name: changes.pop(name, {}) or {} for name in SECTIONS}
        raw.update(changes)
        for name, section in nested.items():
            raw[name] = {**raw[name], **section}
        return ModelConfig.from_dict(raw)


def math_revision(cfg: ModelConfig) -> int:
    """The revision of the training math a model of ``cfg`` trains under: bumped when a change
    made on purpose means a run of ``cfg`` trained before it does not reproduce. 2: issue #25,
    arch "moe" (the stock router's L_aux is the paper's Eq. 2, megatron-core's was half of it;
    every router's weights come from one seed, so the shared weights start as AoE's). Records
    that must not mix runs across revisions (the study's fingerprints) include it."""
    return 2 if cfg.arch == "moe" else 1


#: The package's presets (the repository's run/presets, installed as package data).
PRESET_DIR = resources.path("presets")


def merge_settings(base: dict, over: dict) -> dict:
    """``base`` with ``over`` laid on top, section by section (a preset over the one it extends;
    a study's arm over its shared settings)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merge_settings(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _preset_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if not path.suffix:
        path = PRESET_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        names = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
        raise ValueError(f"no preset {name_or_path!r}: not a file, and not one of {names}")
    return path


def preset_dict(name_or_path: str, _seen=()) -> dict:
    """A preset's YAML as a dict, with ``base: OTHER`` presets merged underneath (variants are data)."""
    import yaml

    path = _preset_path(name_or_path)
    if path in _seen:
        raise ValueError(f"preset {path} inherits from itself")
    raw = yaml.safe_load(path.read_text()) or {}
    unknown = set(raw) - {"base", "model", "train"}
    if unknown:
        raise ValueError(f"unknown preset sections {sorted(unknown)} in {path}: use base, model, train")
    if isinstance(raw.get("model"), dict):  # old key names, before a base's new ones meet them
        raw["model"] = upgrade_sections(raw["model"], where=f"preset {path}")
    if isinstance(raw.get("train"), dict):  # likewise its train: keys (TrainConfig's old names)
        raw["train"] = upgrade_keys(raw["train"], "train_key", where=f"preset {path}: train")
    base = raw.pop("base", None)
    return merge_settings(preset_dict(base, _seen + (path,)), raw) if base else raw


def load_preset(name_or_path: str, **overrides) -> ModelConfig:
    """A preset by name ("tiny", "aoe_732m", "moe_4b", ...) or YAML path, with optional overrides."""
    return model_of_preset(preset_dict(name_or_path), **overrides)


def model_of_preset(preset: dict, **overrides) -> ModelConfig:
    """The model of a preset already read (``preset_dict``), with optional overrides."""
    cfg = ModelConfig.from_dict(preset.get("model", {}))
    return cfg.with_overrides(**overrides) if overrides else cfg


def transformer_config(cfg: ModelConfig, *, expert_parallel_size: int = 1, **extra):
    """megatron-core TransformerConfig for ``cfg``; ``extra`` passes further megatron settings."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_gpu = torch.cuda.is_available()
    kwargs = dict(
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.ffn_hidden_size,
        num_moe_experts=cfg.num_experts,
        moe_router_topk=cfg.top_k,
        moe_ffn_hidden_size=cfg.ffn_hidden_size,
        moe_aux_loss_coeff=cfg.alpha_aux,
        moe_token_dispatcher_type=cfg.dispatcher,
        expert_model_parallel_size=expert_parallel_size,
        num_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        moe_router_pre_softmax=cfg.top_k == 1,  # megatron-core requires it for top-1
        moe_router_load_balancing_type="aux_loss" if cfg.alpha_aux > 0 else "none",
        # megatron-core's expert bias (stock MoE only; AoE's bias is its own: AoELayerConfig).
        moe_router_score_function=cfg.router.score_function,
        moe_router_enable_expert_bias=cfg.arch == "moe" and cfg.expert_bias,
        moe_router_bias_update_rate=cfg.bias_update_rate,
        # The stock router's logits, softmax and top-k in fp32 under bf16 too, as AoE's norms are:
        # a baseline as precise as the model it is compared with (megatron-core's default is the
        # activations' dtype).
        moe_router_dtype="fp32",
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=not on_gpu,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=fused_softmax_available(),  # its kernels come with apex
        gradient_accumulation_fusion=False,
    )
    kwargs.update(extra)
    return TransformerConfig(**kwargs)


def build_gpt_model(cfg: ModelConfig, tc=None, *, use_te: Optional[bool] = None):
    """A megatron-core GPTModel with AoE or stock MoE layers (parallel state must be set up)."""
    from megatron.core.models.gpt import GPTModel

    from aoe_megatron.models.spec import (  # deferred: megatron-core loads at build
        aoe_layer_spec, moe_layer_spec)

    tc = tc or transformer_config(cfg)
    if cfg.arch == "aoe":
        spec = aoe_layer_spec(cfg.aoe_config(tc=tc), use_te=use_te)
    else:
        router = None if cfg.router.is_stock else cfg.router_config()
        spec = moe_layer_spec(cfg.num_experts, use_te=use_te, router=router)
    model = GPTModel(
        config=tc,
        transformer_layer_spec=spec,
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.seq_length,
        share_embeddings_and_output_weights=cfg.tie_embeddings,
        position_embedding_type="rope",
    )
    if cfg.arch == "moe" and cfg.router.gate == "hash":
        from aoe_megatron.models.moe_router import (  # deferred: megatron-core loads at build
            hand_token_ids_to_hash_routers)

        hand_token_ids_to_hash_routers(model)
    return model
