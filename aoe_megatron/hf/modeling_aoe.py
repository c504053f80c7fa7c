"""Autonomy-of-Experts (AoE, arXiv 2501.13074) causal language model for Hugging Face transformers.

Exported by ``aoe-convert-to-hf`` next to ``config.json``; load it with
``AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)``. Self-contained (imports
only torch and transformers). It computes what aoe-megatron's megatron-core GPTModel computes:
pre-norm decoder layers (RMSNorm, rotary attention without biases) whose MLP is an AoE layer.

Weights (``model.safetensors``; L layers, E experts, D hidden, R = d_low, W = d_wide,
H heads, G key/value heads, Dh head dim, V vocabulary):

    model.embed_tokens.weight                          [V, D]
    model.layers.{l}.input_layernorm.weight            [D]
    model.layers.{l}.self_attn.q_proj.weight           [H * Dh, D]
    model.layers.{l}.self_attn.k_proj.weight           [G * Dh, D]
    model.layers.{l}.self_attn.v_proj.weight           [G * Dh, D]
    model.layers.{l}.self_attn.o_proj.weight           [D, H * Dh]
    model.layers.{l}.post_attention_layernorm.weight   [D]
    model.layers.{l}.mlp.w_down                        [D, E * R]  expert i: columns i*R .. (i+1)*R-1
    model.layers.{l}.mlp.w_up                          [E, R, W]
    model.layers.{l}.mlp.w_p                           [E, D, W]
    model.layers.{l}.mlp.w_o                           [E, W, D]
    model.layers.{l}.mlp.expert_bias                   [E]  (only with expert_bias: float32)
    model.norm.weight                                  [D]
    lm_head.weight                                     [V, D]  (absent when tie_word_embeddings)

Per token x (a row of the normalised hidden states):
    C_i = x W_down^i,  p_i = ||C_i||  (l2, l1 or linf)
    I = top-K experts by p (by p + b with expert_bias: the bias chooses, never weights);
    weights: softmax(p_I) ("topk_softmax") or softmax(p)_I ("softmax_topk")
    y = sum_{i in I} w_i * ((SiLU(C_i W_up^i) * (x W_p^i)) W_o^i)
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .configuration_aoe import AoEHFConfig


class AoERMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _inv_freq(config: AoEHFConfig) -> torch.Tensor:
    dim = config.head_dim
    return 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


class AoERotaryEmbedding(nn.Module):
    """Rotary position embedding over the whole head (non-interleaved halves, as megatron-core)."""

    def __init__(self, config: AoEHFConfig):
        super().__init__()
        self.register_buffer("inv_freq", _inv_freq(config), persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        freqs = position_ids[..., None].float() * self.inv_freq.to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rotary(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Plain softmax attention; the mask is additive (0 or -inf) over [B, 1, Tq, Tk]."""
    groups = module.num_key_value_groups
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = F.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


class AoEAttention(nn.Module):
    def __init__(self, config: AoEHFConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        self.is_causal = True
        d, h, g = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.q_proj = nn.Linear(d, h * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, g * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, g * self.head_dim, bias=False)
        self.o_proj = nn.Linear(h * self.head_dim, d, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        q, k = _apply_rotary(q, k, *position_embeddings)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        attention: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        out, weights = attention(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), weights


def expert_norms(cache: torch.Tensor, order: str) -> torch.Tensor:
    """||C_i|| over the last axis, in float32 at least."""
    c = cache.float() if cache.dtype in (torch.float16, torch.bfloat16) else cache
    ord_ = {"l2": 2, "l1": 1, "linf": float("inf")}[order]
    return torch.linalg.vector_norm(c, ord=ord_, dim=-1)


class AoEMLP(nn.Module):
    """The AoE layer: experts rank themselves by the norm of their low-rank cache (no router)."""

    def __init__(self, config: AoEHFConfig):
        super().__init__()
        d, e, r, w = config.hidden_size, config.num_experts, config.d_low, config.d_wide
        self.num_experts, self.top_k, self.d_low = e, config.num_experts_per_tok, r
        self.norm, self.selection = config.norm, config.selection
        self.w_down = nn.Parameter(torch.empty(d, e * r))
        self.w_up = nn.Parameter(torch.empty(e, r, w))
        self.w_p = nn.Parameter(torch.empty(e, d, w))
        self.w_o = nn.Parameter(torch.empty(e, w, d))
        if getattr(config, "expert_bias", False):  # aux-loss-free balancing's bias, as trained
            self.register_buffer("expert_bias", torch.zeros(e, dtype=torch.float32))
        else:
            self.expert_bias = None

    def select(self, norms: torch.Tensor):
        """(expert indices [T, K], weights [T, K]) from the per-expert norms [T, E]."""
        chooser = norms if self.expert_bias is None else norms + self.expert_bias.to(norms.dtype)
        index = torch.topk(chooser, self.top_k, dim=-1).indices
        if self.selection == "topk_softmax":
            weights = torch.softmax(norms.gather(-1, index), dim=-1)
        else:  # softmax_topk
            weights = torch.softmax(norms, dim=-1).gather(-1, index)
        return index, weights

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        cache = (x @ self.w_down).view(x.shape[0], self.num_experts, self.d_low)
        index, weights = self.select(expert_norms(cache, self.norm))
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            token, slot = torch.where(index == e)
            if token.numel() == 0:
                continue
            x_e, c_e = x[token], cache[token, e]
            y = (F.silu(c_e @ self.w_up[e]) * (x_e @ self.w_p[e])) @ self.w_o[e]
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        return out.view(shape)


class AoEDecoderLayer(nn.Module):
    def __init__(self, config: AoEHFConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = AoERMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = AoEAttention(config, layer_idx)
        self.post_attention_layernorm = AoERMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = AoEMLP(config)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None, **kwargs):
        attn, _ = self.self_attn(self.input_layernorm(hidden_states), position_embeddings,
                                 attention_mask, past_key_values, **kwargs)
        hidden_states = hidden_states + attn
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class AoEPreTrainedModel(PreTrainedModel):
    config_class = AoEHFConfig
    config: AoEHFConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["AoEDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_attention_backend = True

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, AoEMLP):
            for p in (module.w_down, module.w_up, module.w_p, module.w_o):
                p.normal_(0.0, std)
            if module.expert_bias is not None:
                module.expert_bias.zero_()
        elif isinstance(module, AoERMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, AoERotaryEmbedding):
            # non-persistent: not in the checkpoint, so recomputed here after loading
            module.inv_freq.copy_(_inv_freq(self.config))


class AoEModel(AoEPreTrainedModel):
    def __init__(self, config: AoEHFConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(AoEDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = AoERMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = AoERotaryEmbedding(config)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None,
                past_key_values: Optional[Cache] = None, inputs_embeds=None, use_cache=None, **kwargs):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if position_ids is None:
            seen = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + seen)[None]
        mask = create_causal_mask(config=self.config, inputs_embeds=inputs_embeds,
                                  attention_mask=attention_mask, past_key_values=past_key_values,
                                  position_ids=position_ids)
        hidden = inputs_embeds
        position_embeddings = self.rotary_emb(hidden, position_ids)
        for layer in self.layers:
            hidden = layer(hidden, position_embeddings, mask, past_key_values, **kwargs)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden),
                                       past_key_values=past_key_values if use_cache else None)


class AoEForCausalLM(AoEPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: AoEHFConfig):
        super().__init__(config)
        self.model = AoEModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds,
                         use_cache=use_cache, **kwargs)
        hidden = out.last_hidden_state
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            hidden = hidden[:, -logits_to_keep:]
        elif not isinstance(logits_to_keep, int):
            hidden = hidden[:, logits_to_keep]
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=out.past_key_values)


__all__ = ["AoEForCausalLM", "AoEModel", "AoEPreTrainedModel"]
