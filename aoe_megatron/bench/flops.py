"""Analytic FLOP counts of one AoE block, one MoE block and a GPT model step (pure functions).

Shape suffixes / symbols: T tokens, D d_model, E experts, K top-k, R d_low, W d_wide, F d_ffn
(the MoE expert width), L layers, S sequence length, V vocabulary. One multiply-add is 2 FLOPs;
element-wise work (activations, norms, softmax, permutation) is not counted.

"Model FLOPs" are the FLOPs the architecture needs; "hardware FLOPs" add what a recompute option
executes again in the backward pass (reported separately, never in the utilisation figure).
"""

from __future__ import annotations

RECOMPUTE_OPTIONS = ("moe_layer", "lean_cache", "low_rank", "moe_act")


def aoe_block_forward_flops(*, tokens: int, d_model: int, num_experts: int, top_k: int,
                            d_low: int, d_wide: int) -> int:
    """Forward FLOPs of one AoE block (paper Eqs. 3-4, factorized gate):

        2 T D E R            the low-rank cache C = x [W_down^1 ... W_down^E] (Eq. 4)
      + 2 T K (R W + 2 D W)  per selected expert: C_i W_up, x W_p and the output projection W_o
    """
    cache = 2 * tokens * d_model * num_experts * d_low
    experts = 2 * tokens * top_k * (d_low * d_wide + 2 * d_model * d_wide)
    return cache + experts


def moe_block_forward_flops(*, tokens: int, d_model: int, num_experts: int, top_k: int,
                            d_ffn: int) -> int:
    """Forward FLOPs of one traditional (SwiGLU) MoE block:

        2 T D E        the router logits x W_r
      + 2 T K 3 D F    per selected expert: gate, up and down projections
    """
    return 2 * tokens * d_model * num_experts + 2 * tokens * top_k * 3 * d_model * d_ffn


def training_flops(forward_flops: int) -> int:
    """Forward + backward = 3 x forward (the backward computes input and weight gradients)."""
    return 3 * forward_flops


def recompute_extra_flops(option: str, *, tokens: int, d_model: int, num_experts: int,
                          top_k: int, d_low: int = 0, d_wide: int = 0, d_ffn: int = 0,
                          arch: str = "aoe") -> int:
    """Hardware FLOPs a recompute option adds to one block's training step (forward re-run in the
    backward pass; not model FLOPs):

      moe_layer   the whole block's forward again (megatron recompute_modules ["moe"]);
      lean_cache  AoE: the cache x W_down again, 2 T D E R (lean_cache keeps only x);
      low_rank    AoE: C_i W_up^i again, 2 T K R W (recompute_low_rank);
      moe_act     MoE: the expert activation only: element-wise, 0 matmul FLOPs.
    """
    if option == "moe_layer":
        if arch == "aoe":
            return aoe_block_forward_flops(tokens=tokens, d_model=d_model, num_experts=num_experts,
                                           top_k=top_k, d_low=d_low, d_wide=d_wide)
        return moe_block_forward_flops(tokens=tokens, d_model=d_model, num_experts=num_experts,
                                       top_k=top_k, d_ffn=d_ffn)
    if option == "lean_cache":
        return 2 * tokens * d_model * num_experts * d_low
    if option == "low_rank":
        return 2 * tokens * top_k * d_low * d_wide
    if option == "moe_act":
        return 0
    raise ValueError(f"unknown recompute option {option!r}; choose one of {RECOMPUTE_OPTIONS}")


def model_step_flops(*, tokens: int, matmul_params: int, num_layers: int, d_model: int,
                     seq_length: int) -> int:
    """Model FLOPs of one training step of a decoder (PaLM appendix B convention):

        6 N T + 12 L D S T

    N: the parameters every token multiplies by (attention, router or every W_down, the K
    selected experts, the output projection; not the input embedding, a lookup). 12 L D S T:
    attention scores and values (2 x 2 S D per token and layer forward, x 3 for fwd + bwd),
    counted without the causal half, as PaLM does.
    """
    return 6 * matmul_params * tokens + 12 * num_layers * d_model * seq_length * tokens
