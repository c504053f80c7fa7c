"""Patch for ``megatron/core/transformer/moe/router.py`` (megatron-core 0.16.1), CPU only.

What: ``Router.gating`` computes the router logits where the weight already is.
Why: upstream moves a CPU router weight to ``torch.cuda.current_device()`` on the first forward,
which fails without CUDA (the stock "traditional MoE" baseline needs this router).
"""

from __future__ import annotations

import torch

from ._patching import cuda_absent, module, replace

TARGET = "megatron.core.transformer.moe.router"


def _gating(self, input: torch.Tensor) -> torch.Tensor:
    router_dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(
        self.config.moe_router_dtype, input.dtype
    )
    return module(TARGET).router_gating_linear(input, self.weight, self.bias, router_dtype)


def apply() -> bool:
    if not cuda_absent():
        return False
    replace(module(TARGET).Router, "gating", _gating)
    return True
