"""Megatron-LM's model-shape flags as aoe-train's spellings of a preset's ``model:`` keys, and the
sentence an unknown flag gets.

``--num-layers 4`` is ``--set num_layers=4``: the value is read as YAML and checked by
``ModelConfig`` (the model's one schema), as ``--set``'s is. Giving an alias and ``--set`` of the
same key, or two aliases of one key with different values, is refused (``ValueError``): neither
silently wins. Only an unknown flag's lookup of the model keys imports torch (``hint``).
"""

from __future__ import annotations

import difflib
from typing import NamedTuple, Optional

from aoe_megatron.train.values import TRAIN_LEGACY_KEYS


class ModelFlag(NamedTuple):
    key: str
    """The preset's model key it sets (dotted inside a section: ``router.score_function``)."""
    metavar: Optional[str]
    help: str
    switch: Optional[str] = None
    """For a flag without a value: the value it sets ("true", "false")."""


#: Megatron-LM's flag -> the model key it sets, in the help's order.
MODEL_FLAGS = {
    "--num-layers": ModelFlag("num_layers", "N", "transformer layers"),
    "--hidden-size": ModelFlag("hidden_size", "N", "model width (d_model)"),
    "--ffn-hidden-size": ModelFlag("ffn_hidden_size", "N", "each expert's FFN width (d_ffn; AoE "
                                   "derives d_wide from it)"),
    "--moe-ffn-hidden-size": ModelFlag("ffn_hidden_size", "N", "the same as --ffn-hidden-size: "
                                       "every layer is an MoE layer, with one expert width"),
    "--num-attention-heads": ModelFlag("num_attention_heads", "N", "attention heads"),
    "--seq-length": ModelFlag("seq_length", "N", "tokens per training sequence"),
    "--vocab-size": ModelFlag("vocab_size", "N", "rows of the embedding and output layer (at "
                              "least the tokenizer's vocabulary)"),
    "--num-experts": ModelFlag("num_experts", "N", "experts per MoE layer"),
    "--moe-router-topk": ModelFlag("top_k", "K", "experts per token"),
    "--moe-aux-loss-coeff": ModelFlag("alpha_aux", "X", "load-balancing loss weight (0: none)"),
    "--moe-token-dispatcher-type": ModelFlag("dispatcher", "{alltoall,allgather}",
                                             "expert-parallel token dispatcher"),
    "--moe-router-score-function": ModelFlag("router.score_function", "{softmax,sigmoid}",
                                             "arch moe: the router's scores"),
    "--moe-router-enable-expert-bias": ModelFlag("expert_bias", None, "aux-loss-free load "
                                                 "balancing: a per-expert bias on the selection "
                                                 "scores", switch="true"),
    "--moe-router-bias-update-rate": ModelFlag("bias_update_rate", "X", "how far each expert's "
                                               "bias moves per step"),
    "--untie-embeddings-and-output-weights": ModelFlag("tie_embeddings", None, "separate input "
                                                       "embedding and output layer matrices",
                                                       switch="false"),
}

#: Megatron-LM flags aoe-train does not take -> what it does instead (the common ones).
UNSUPPORTED = {
    "--max-position-embeddings": "RoPE has no position table: the longest sequence is "
                                 "--seq-length",
    "--position-embedding-type": "the models always use RoPE",
    "--use-rotary-position-embeddings": "the models always use RoPE",
    "--normalization": "the models always use RMSNorm",
    "--swiglu": "the experts are always SwiGLU",
    "--disable-bias-linear": "the models have no biases",
    "--hidden-dropout": "the models train without dropout",
    "--attention-dropout": "the models train without dropout",
    "--group-query-attention": "grouped-query attention is not supported",
    "--num-query-groups": "grouped-query attention is not supported",
    "--lr-decay-style": "the learning rate warms up linearly (--lr-warmup-iters), then decays by "
                        "cosine to --min-lr",
    "--lr-decay-iters": "the cosine decay runs to the end of the run (--train-iters)",
    "--lr-warmup-fraction": "warm-up is given in steps: --lr-warmup-iters",
    "--train-samples": "the run's length is --train-iters (steps) or --train-tokens",
    "--lr-decay-samples": "the cosine decay runs to the end of the run (--train-iters)",
    "--lr-warmup-samples": "warm-up is given in steps: --lr-warmup-iters",
    "--fp16": "fp16 is not supported: --bf16, or --precision fp32",
    "--use-distributed-optimizer": "DeepSpeed ZeRO partitions the optimizer state: --zero-stage",
    "--sequence-parallel": "only expert and data parallelism (tensor-parallel size 1)",
    "--context-parallel-size": "only expert and data parallelism",
    "--recompute-activations": "recomputation is per MoE layer: --moe-layer-recompute",
    "--recompute-granularity": "recomputation is per MoE layer: --moe-layer-recompute",
    "--tokenizer-type": "the data's manifest names its tokenizer (aoe-preprocess "
                        "--tokenizer-type); --tokenizer-model checks it",
    "--vocab-file": "tokenizers are sentencepiece models: --tokenizer-model",
    "--merge-file": "tokenizers are sentencepiece models: --tokenizer-model",
    "--finetune": "--load-weights STEP_DIR starts from a checkpoint's weights with a fresh "
                  "optimizer and schedule",
    "--no-load-optim": "--load-weights STEP_DIR starts from a checkpoint's weights with a fresh "
                       "optimizer and schedule",
    "--exit-interval": "a run stops at --train-iters, or saves and stops on SIGTERM/SIGUSR1",
    "--exit-duration-in-mins": "a run stops at --train-iters, or saves and stops on "
                               "SIGTERM/SIGUSR1",
}


def with_model_flags(given: dict, overrides: tuple) -> tuple:
    """``--set``'s KEY=VALUE items (``overrides``) with the aliases ``given`` (flag -> value, as
    typed) added as items of their own; an alias and ``--set`` of one key: ``ValueError``."""
    set_keys = {str(item).partition("=")[0] for item in overrides}
    chosen: dict = {}  # key -> (flag, value)
    for spelling, value in given.items():
        key = MODEL_FLAGS[spelling].key
        if key in set_keys:
            raise ValueError(f"{spelling} {value} and --set {key}=... both set the model's {key}: "
                             f"give one of them ({spelling} is Megatron-LM's spelling of --set "
                             f"{key}=VALUE)")
        if key in chosen and chosen[key][1] != value:
            other, was = chosen[key]
            raise ValueError(f"{other} {was} and {spelling} {value} both set the model's {key}, "
                             f"differently: give one value")
        chosen[key] = (spelling, value)
    return tuple(overrides) + tuple(f"{key}={value}" for key, (_, value) in chosen.items())


def _model_keys() -> list:
    """The preset's model keys (``num_layers``, ``aoe.d_low``, ...), read from the schema's
    dataclasses (torch is imported here: only on a mistyped flag)."""
    from dataclasses import fields

    from aoe_megatron.models.gpt import ModelConfig  # deferred: torch loads after --help
    from aoe_megatron.models.settings import SECTIONS  # deferred: torch loads after --help

    keys = [f.name for f in fields(ModelConfig) if f.name not in SECTIONS]
    return keys + [f"{name}.{f.name}" for name, cls in SECTIONS.items() for f in fields(cls)]


def hint(token: str, prog: str, our_flags: list, train_keys: dict) -> Optional[str]:
    """A sentence for an unknown flag ``token`` (``--foo`` or ``--foo=1``), or None: Megatron-LM's
    flag we do not take, a model key (``--set``), a preset train key or our flag misspelt.
    ``train_keys``: the preset's train keys -> their flags."""
    name = token.split("=", 1)[0]
    if name in UNSUPPORTED:
        return f"{name} is a Megatron-LM flag {prog} does not support: {UNSUPPORTED[name]}"
    bare = name.lstrip("-").replace("-", "_")
    if bare in train_keys:
        key = TRAIN_LEGACY_KEYS.get(bare)
        key = f"{key}, formerly {bare}" if key else bare
        return f"{name}: did you mean {train_keys[bare]} (the preset's train key {key})?"
    dashed = "--" + bare.replace("_", "-")
    if dashed in our_flags:
        return f"{name}: did you mean {dashed}?"
    try:
        model_keys = _model_keys()
    except ImportError:  # an unsupported megatron-core: the refusal comes later, with its reason
        model_keys = []
    key = bare if bare in model_keys else next(
        (k for k in model_keys if k.rpartition(".")[2] == bare), None)  # d_low: aoe.d_low
    if key is not None:
        return f"{name}: did you mean --set {key}=VALUE (the preset's model key {key})?"
    close = difflib.get_close_matches(name, our_flags, n=1, cutoff=0.8)
    if close:
        return f"{name}: did you mean {close[0]}?"
    return None
