"""Patch for ``megatron/core/transformer/utils.py`` (megatron-core 0.16.1, 0.19.2), CPU only.

What: ``get_default_causal_mask`` builds the causal mask on the CPU.
Why: upstream builds it with ``device="cuda"``; the local (non-TE) attention calls it on every
forward without an explicit mask. ``fusions/fused_softmax.py`` imports the function by name, so
that binding is replaced too.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

from ._patching import cuda_absent, replace_bound

if TYPE_CHECKING:
    import torch

TARGET = "megatron.core.transformer.utils"
#: The supported megatron-core releases this patch applies to.
VERSIONS = ("0.16.1", "0.19.2")


@lru_cache
def _get_default_causal_mask(sq: int) -> torch.Tensor:
    import torch

    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def apply() -> bool:
    if not cuda_absent():
        return False
    replace_bound("get_default_causal_mask", _get_default_causal_mask,
                  TARGET, "megatron.core.fusions.fused_softmax")
    return True
