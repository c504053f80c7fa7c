"""The one table between megatron-core parameters and Hugging Face tensors.

``links(cfg, groups)`` says, per layer, which megatron-core parameter becomes which Hugging Face
tensors and how (QKV split per query group, GLU halves split): export (``to_hf``) reads it one
way, import (``from_hf``) the other, so the round trip is exact by construction and tested.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from aoe_megatron.hf.checkpoint_io import ConversionError
from aoe_megatron.models.gpt import ModelConfig


def _ident(t):
    return [t]


def _cat0(parts):
    return torch.cat(parts, dim=0)


@dataclass(frozen=True)
class Link:
    """megatron parameter <-> Hugging Face tensors.

    ``dist_key`` is the layer-stacked key of the distributed checkpoint; ``index`` selects this
    parameter's slice of it ((layer,) or (layer, expert)); ``split`` turns the megatron tensor
    into the Hugging Face tensors (in ``hf`` order) and ``merge`` is its inverse.
    """

    param: str
    dist_key: str
    index: tuple
    hf: tuple
    split: Callable = _ident
    merge: Callable = lambda parts: parts[0]


def _qkv_ops(heads: int, groups: int, head_dim: int):
    """megatron-core packs QKV per query group: [q (heads/groups heads), k, v] for each group."""
    per = heads // groups

    def split(w):
        w = w.reshape(groups, per + 2, head_dim, -1)
        d = w.shape[-1]
        return [w[:, :per].reshape(-1, d), w[:, per].reshape(-1, d), w[:, per + 1].reshape(-1, d)]

    def merge(parts):
        q, k, v = parts
        d = q.shape[-1]
        q = q.reshape(groups, per, head_dim, d)
        return torch.cat([q, k.reshape(groups, 1, head_dim, d), v.reshape(groups, 1, head_dim, d)],
                         dim=1).reshape(-1, d)

    return split, merge


def _glu_split(w):
    return list(torch.chunk(w, 2, dim=0))  # megatron-core's linear_fc1: [gate; up]


def links(cfg, num_query_groups: int) -> list:
    """Every parameter of the model ``cfg`` (a ModelConfig), in Hugging Face write order."""
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    qkv_split, qkv_merge = _qkv_ops(cfg.num_attention_heads, num_query_groups, head_dim)
    links = [Link("embedding.word_embeddings.weight", "embedding.word_embeddings.weight", (),
                  ("model.embed_tokens.weight",))]
    for l in range(cfg.num_layers):
        m, h = f"decoder.layers.{l}.", f"model.layers.{l}."
        links += [
            Link(m + "input_layernorm.weight", "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
                 (l,), (h + "input_layernorm.weight",)),
            Link(m + "self_attention.linear_qkv.weight", "decoder.layers.self_attention.linear_qkv.weight",
                 (l,), tuple(h + f"self_attn.{p}_proj.weight" for p in "qkv"), qkv_split, qkv_merge),
            Link(m + "self_attention.linear_proj.weight", "decoder.layers.self_attention.linear_proj.weight",
                 (l,), (h + "self_attn.o_proj.weight",)),
            Link(m + "pre_mlp_layernorm.weight", "decoder.layers.mlp.linear_fc1.layer_norm_weight",
                 (l,), (h + "post_attention_layernorm.weight",)),
        ]
        if cfg.arch == "aoe":
            links.append(Link(m + "mlp.router.weight", "decoder.layers.mlp.router.weight", (l,),
                              (h + "mlp.w_down",)))
            links += [Link(m + f"mlp.experts.{w}", f"decoder.layers.mlp.experts.{w}", (l,), (h + f"mlp.{w}",))
                      for w in ("w_up", "w_p", "w_o")]
            if cfg.expert_bias:
                links.append(Link(m + "mlp.router.expert_bias", "decoder.layers.mlp.router.expert_bias",
                                  (l,), (h + "mlp.expert_bias",)))
        else:
            moe = h + "block_sparse_moe."
            links.append(Link(m + "mlp.router.weight", "decoder.layers.mlp.router.weight", (l,),
                              (moe + "gate.weight",)))
            for e in range(cfg.num_experts):
                links.append(Link(
                    m + f"mlp.experts.local_experts.{e}.linear_fc1.weight",
                    "decoder.layers.mlp.experts.experts.linear_fc1.weight", (l, e),
                    (moe + f"experts.{e}.w1.weight", moe + f"experts.{e}.w3.weight"), _glu_split, _cat0))
            for e in range(cfg.num_experts):
                links.append(Link(
                    m + f"mlp.experts.local_experts.{e}.linear_fc2.weight",
                    "decoder.layers.mlp.experts.experts.linear_fc2.weight", (l, e),
                    (moe + f"experts.{e}.w2.weight",)))
    links.append(Link("decoder.final_layernorm.weight", "decoder.final_layernorm.weight", (),
                      ("model.norm.weight",)))
    if not cfg.tie_embeddings:
        links.append(Link("output_layer.weight", "output_layer.weight", (), ("lm_head.weight",)))
    return links


def model_config(raw: dict):
    """A ModelConfig from a recorded dict; a bad one is a ConversionError."""
    try:
        return ModelConfig.from_dict(raw)
    except (TypeError, ValueError) as exc:
        raise ConversionError(f"invalid model configuration: {exc}") from None
