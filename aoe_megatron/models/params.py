"""Total and active parameter counts of a model config, without allocating the model.

Conventions (they reproduce both of the paper's pairs, 732M / 247M and 4B / 1.18B, within 1%):
- embeddings are tied: the shared [vocab, d_model] matrix counts once in the total;
- a token's *active* parameters are the attention and norm weights, the router (MoE), the K
  selected experts in full, the input embedding and the output projection. The output
  projection counts as active even when tied to the embedding, since every token multiplies by it;
- AoE's active count, like the paper's, counts the K selected experts in full; the W_down slices
  of the unselected experts, which every token also multiplies by, are reported separately
  (``active_with_all_caches``).
RoPE has no parameters, so the sequence length changes no count.
"""

from __future__ import annotations

from dataclasses import dataclass

from aoe_megatron.models.gpt import ModelConfig


@dataclass(frozen=True)
class ParamCount:
    total: int
    active: int
    active_with_all_caches: int
    per_layer: dict
    embedding: int


def count_parameters(cfg: ModelConfig) -> ParamCount:
    d, e, k, f = cfg.hidden_size, cfg.num_experts, cfg.top_k, cfg.ffn_hidden_size
    attention = 4 * d * d  # fused QKV (3 d^2, no GQA) + output projection (d^2), no biases
    norms = 2 * d  # input RMSNorm + pre-MLP RMSNorm
    if cfg.arch == "moe":
        router = e * d  # megatron-core's linear router [E, D]
        if cfg.router.gate == "two_layer":  # Config 4: W_1 [D, E * h], W_2 [E * h, E]
            router = e * cfg.router.hidden_per_expert * (d + e)
        elif cfg.router.gate == "hash":  # a table, no weights
            router = 0
        expert = 3 * d * f  # SwiGLU: gate and up [d, f], down [f, d]
        layer_total = attention + norms + router + e * expert
        layer_active = attention + norms + router + k * expert
        layer_all_caches = layer_active
        experts = {"router": router, "expert": expert}
    else:
        aoe = cfg.aoe_config()
        r, w = aoe.d_low, aoe.resolved_d_wide
        w_down = d * r
        # W_up [r, w] (or W_g's last w - r columns, [d, w - r]), W_p [d, w], W_o [w, d]
        expert_rest = (d * (w - r) if aoe.factorized == "none" else r * w) + 2 * d * w
        # Config 3's linear router; the imitation router (evaluated alone, trained beside)
        router = e * d * ((aoe.rank_source == "router") + (aoe.inference_selection == "router"))
        layer_total = attention + norms + router + e * (w_down + expert_rest)
        layer_active = attention + norms + router + k * (w_down + expert_rest)
        layer_all_caches = attention + norms + router + e * w_down + k * expert_rest
        experts = {"w_down": w_down, "expert_without_w_down": expert_rest, "d_wide": w,
                   "router": router}
    embedding = cfg.vocab_size * d
    output_layer = 0 if cfg.tie_embeddings else embedding
    final_norm = d
    n = cfg.num_layers
    return ParamCount(
        total=n * layer_total + embedding + output_layer + final_norm,
        active=n * layer_active + 2 * embedding + final_norm,
        active_with_all_caches=n * layer_all_caches + 2 * embedding + final_norm,
        per_layer={"attention": attention, "norms": norms, **experts, "layer_total": layer_total},
        embedding=embedding,
    )
