"""Hugging Face configuration of an Autonomy-of-Experts (AoE) causal language model.

Written next to the weights by ``aoe-convert-to-hf``; loaded with
``AutoConfig.from_pretrained(path, trust_remote_code=True)``. Self-contained: it imports only
transformers, so the exported folder works without aoe-megatron installed.
"""

import warnings

from transformers import PretrainedConfig

NORM_ORDERS = ("l2", "l1", "linf")
SELECTIONS = ("topk_softmax", "softmax_topk")


class AoEHFConfig(PretrainedConfig):
    r"""A Llama-style decoder (RMSNorm, RoPE, no biases) whose MLPs are AoE layers (arXiv 2501.13074).

    Per layer and token x: every expert i computes its cache C_i = x W_down^i (width ``d_low``);
    experts are ranked by ||C_i|| (``norm``), the top ``num_experts_per_tok`` continue with
    (SiLU(C_i W_up^i) * x W_p^i) W_o^i (width ``d_wide``), weighted by ``selection``:
    "topk_softmax" (softmax over the selected norms, the paper's Algorithm 2) or "softmax_topk"
    (softmax over all norms, the selected weights kept unnormalised). ``selection`` was called
    ``weight_mode`` before: a config.json with that key still loads (with a DeprecationWarning).
    """

    model_type = "aoe"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 1024,
        num_hidden_layers: int = 24,
        num_attention_heads: int = 16,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        num_experts: int = 8,
        num_experts_per_tok: int = 2,
        d_low: int = 256,
        d_wide: int = 1024,
        norm: str = "l2",
        selection: str | None = None,
        expert_bias: bool = False,
        max_position_embeddings: int = 2048,
        rope_theta: float = 10000.0,
        rms_norm_eps: float = 1e-5,
        initializer_range: float = 0.02,
        use_cache: bool = True,
        tie_word_embeddings: bool = True,
        bos_token_id: int = 1,
        eos_token_id: int = 2,
        pad_token_id: int | None = None,
        **kwargs,
    ):
        if norm not in NORM_ORDERS:
            raise ValueError(f"norm must be one of {NORM_ORDERS}, got {norm!r}")
        if "weight_mode" in kwargs:  # config.json files exported before the rename
            if selection is not None:
                raise ValueError("the AoE config sets both 'weight_mode' and 'selection': "
                                 "'weight_mode' is the old name of 'selection'; keep 'selection' only.")
            warnings.warn("AoE config: 'weight_mode' is deprecated, renamed 'selection'.",
                          DeprecationWarning, stacklevel=2)
            selection = kwargs.pop("weight_mode")
        selection = "topk_softmax" if selection is None else selection
        if selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS}, got {selection!r}")
        if not 0 < num_experts_per_tok <= num_experts:
            raise ValueError(f"num_experts_per_tok={num_experts_per_tok} must be in [1, {num_experts}]")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.d_low = d_low
        self.d_wide = d_wide
        self.norm = norm
        self.selection = selection
        self.expert_bias = expert_bias
        self.max_position_embeddings = max_position_embeddings
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        self.tie_word_embeddings = tie_word_embeddings
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        super().__init__(**kwargs)


__all__ = ["AoEHFConfig"]
