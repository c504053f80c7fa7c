"""Where a training step's FLOPs go, per token, for a model preset (pure arithmetic over its shape).

Symbols as in aoe_megatron.bench.flops: D d_model, L layers, S sequence length, V vocabulary,
E experts, K top-k, F d_ffn, R d_low, W d_wide. Training FLOPs = 3 x forward (training_flops);
per token and per step:

    output layer   6 V D                 (the logits; the input embedding is a lookup)
    attention      L (6 4 D^2 + 12 D S)  (QKV and output projections: no GQA in our models,
                                          transformer_config leaves num_query_groups unset;
                                          scores and values as model_step_flops counts them)
    MoE blocks     3 L moe_block_forward_flops / aoe_block_forward_flops (T = 1), plus a
                   router's 2 D E where an AoE arm has one (Config 3)
"""

from __future__ import annotations

from aoe_megatron.bench.flops import aoe_block_forward_flops, moe_block_forward_flops, training_flops
from aoe_megatron.models.gpt import ModelConfig
from aoe_megatron.models.params import count_parameters

PARTS = ("output_layer", "attention", "moe_blocks")


def split_of_model(model: dict) -> dict:
    """Per-token training FLOPs of a preset's ``model`` section by part, their fractions, the
    parameter counts (count_parameters) and AoE's d_wide (Eq. 5, as the model resolves it)."""
    cfg = ModelConfig.from_dict(model)
    d, n, s, v = cfg.hidden_size, cfg.num_layers, cfg.seq_length, cfg.vocab_size
    count = count_parameters(cfg)
    shape = {"arch": cfg.arch, "d_model": d, "layers": n, "heads": cfg.num_attention_heads, "seq": s,
             "vocab": v, "experts": cfg.num_experts, "top_k": cfg.top_k, "d_ffn": cfg.ffn_hidden_size}
    if cfg.arch == "moe":
        block = moe_block_forward_flops(tokens=1, d_model=d, num_experts=cfg.num_experts,
                                        top_k=cfg.top_k, d_ffn=cfg.ffn_hidden_size)
        block += 2 * (count.per_layer["router"] - d * cfg.num_experts)  # a non-linear router's extra
    else:
        aoe = cfg.aoe_config()
        r, w = aoe.d_low, aoe.resolved_d_wide
        shape.update(d_low=r, d_wide=w)
        if aoe.factorized == "none":  # W_g's last W - R columns instead of W_up: from the counts
            block = 2 * (cfg.num_experts * count.per_layer["w_down"]
                         + cfg.top_k * count.per_layer["expert_without_w_down"])
        else:
            block = aoe_block_forward_flops(tokens=1, d_model=d, num_experts=cfg.num_experts,
                                            top_k=cfg.top_k, d_low=r, d_wide=w)
        block += 2 * count.per_layer["router"]
    flops = {"output_layer": 6 * v * d, "attention": n * (6 * 4 * d * d + 12 * d * s),
             "moe_blocks": n * training_flops(block)}
    total = sum(flops.values())
    return {"shape": shape, "flops_per_token": flops, "total_per_token": total,
            "fractions": {k: f / total for k, f in flops.items()},
            "params": {"total": count.total, "active": count.active, "embedding": count.embedding}}


def stage_splits(stage: dict, *, prefer: dict | None = None) -> dict:
    """{arch: split_of_model(...) + {"arm", "run_id"}} for the stage's MoE and AoE shapes; a
    shape is the run of the arm ``prefer[arch]`` when the stage has one, else its first run of
    that arch, else the stage's ``shapes`` ({arm: model}, before any run finished)."""
    prefer = prefer or {"moe": "moe", "aoe": "aoe"}
    picked = {}
    for rid, run in (stage.get("runs") or {}).items():
        model = (run.get("preset") or {}).get("model")
        if not model:
            continue
        arch = model.get("arch", "aoe")
        preferred = run.get("arm") == prefer.get(arch)
        if arch not in picked or (preferred and picked[arch]["arm"] != prefer.get(arch)):
            picked[arch] = {"arm": run.get("arm"), "run_id": rid, "model": model}
    for arm, model in (stage.get("shapes") or {}).items():  # the stage's shapes before any run
        arch = model.get("arch", "aoe")
        if arch not in picked:
            picked[arch] = {"arm": arm, "run_id": "", "model": model}
    return {arch: {"arm": p["arm"], "run_id": p["run_id"], **split_of_model(p["model"])}
            for arch, p in sorted(picked.items(), key=lambda kv: kv[0] != "moe")}
