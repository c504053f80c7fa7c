"""Patch for ``megatron/core/transformer/utils.py`` (megatron-core 0.16.1), CPU only.

What: ``get_default_causal_mask`` builds the causal mask on the CPU.
Why: upstream builds it with ``device="cuda"``; the local (non-TE) attention calls it on every
forward without an explicit mask. ``fusions/fused_softmax.py`` imports the function by name, so
that binding is replaced too.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from patches._patching import cuda_absent, module, replace

TARGET = "megatron.core.transformer.utils"


@lru_cache
def _get_default_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def apply() -> bool:
    if not cuda_absent():
        return False
    # NOTE: import the by-name importer first, so it binds (and we record) upstream's function.
    fused_softmax = module("megatron.core.fusions.fused_softmax")
    replace(module(TARGET), "get_default_causal_mask", _get_default_causal_mask)
    replace(fused_softmax, "get_default_causal_mask", _get_default_causal_mask)
    return True
