"""Patch for ``megatron/core/transformer/moe/token_dispatcher.py`` (megatron-core 0.16.1, 0.19.2), CPU only.

What: the all-to-all dispatcher creates no CUDA stream and moves its split sizes to the CPU
synchronously.
Why: ``MoEAlltoAllTokenDispatcher.__init__`` creates ``torch.cuda.Stream()`` and
``_maybe_dtoh_and_synchronize`` copies on that stream and waits on a CUDA event; both fail without
CUDA, for any all-to-all dispatcher (EP = 1 too). On the CPU there is nothing to overlap.
"""

from __future__ import annotations

import contextlib

from ._patching import cuda_absent, module, replace

TARGET = "megatron.core.transformer.moe.token_dispatcher"
#: The supported megatron-core releases this patch applies to.
VERSIONS = ("0.16.1", "0.19.2")


def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
    to_cpu = module("megatron.core.transformer.moe.moe_utils").maybe_move_tensor_to_cpu
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        tokens_per_expert = to_cpu(tokens_per_expert)
        self.input_splits = to_cpu(self.input_splits, as_numpy=True)
        self.output_splits = to_cpu(self.output_splits, as_numpy=True)
        self.output_splits_tp = to_cpu(self.output_splits_tp, as_numpy=True)
        self.num_out_tokens = to_cpu(self.num_out_tokens)
        if self.num_local_experts > 1 and not self.config.moe_permute_fusion:
            self.num_global_tokens_per_local_expert = to_cpu(
                self.num_global_tokens_per_local_expert
            )
    return tokens_per_expert


def apply() -> bool:
    if not cuda_absent():
        return False
    cls = module(TARGET).MoEAlltoAllTokenDispatcher
    # NOTE: a non-None placeholder makes __init__ skip ``torch.cuda.Stream()``.
    replace(cls, "cuda_dtoh_stream", contextlib.nullcontext())
    replace(cls, "_maybe_dtoh_and_synchronize", _maybe_dtoh_and_synchronize)
    return True
