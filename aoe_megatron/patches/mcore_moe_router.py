"""Patch for ``megatron/core/transformer/moe/router.py`` (megatron-core 0.16.1, 0.19.2), CPU only.

What: ``Router.gating`` computes the router logits where the weight already is.
Why: upstream moves a CPU router weight to ``torch.cuda.current_device()`` on the first forward,
which fails without CUDA (the stock "traditional MoE" baseline needs this router).

What (0.19.2, ``COMPILED_AT_IMPORT``): while the module executes, ``torch.compile`` used as a
decorator returns the function unchanged.
Why: 0.19.2 decorates ``InferenceTopKRouter``'s routing with a bare ``@torch.compile`` (not
megatron-core's ``jit_fuser``, so ``mcore_jit`` does not reach it). Building that wrapper loads
TorchDynamo and Inductor's compiler at ``import megatron.core``: about 5 s to import against
1.5 s, on every CPU process, for an inference-only kernel our training never calls. :func:`arm`
(from ``import aoe_megatron``, before megatron-core loads) hooks the module's execution.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._patching import cuda_absent, module, replace, when_loading
from aoe_megatron.runtime.versions import baseline_release

if TYPE_CHECKING:
    import torch

TARGET = "megatron.core.transformer.moe.router"
#: The supported megatron-core releases this patch applies to.
VERSIONS = ("0.16.1", "0.19.2")
#: The releases whose router.py decorates with a bare ``torch.compile`` at import.
COMPILED_AT_IMPORT = ("0.19.2",)


def _uncompiled(fn=None, **options):
    """``torch.compile`` as a no-op: ``@torch.compile`` and ``@torch.compile(...)`` alike."""
    return (lambda f: f) if fn is None else fn


def _without_torch_compile(run_module):
    def exec_module(router):
        if not cuda_absent():
            return run_module(router)
        import torch

        compile_ = torch.compile
        torch.compile = _uncompiled
        try:
            run_module(router)
        finally:
            torch.compile = compile_
    return exec_module


def arm() -> None:
    """Hook router.py's import where its release compiles at import (no effect with CUDA)."""
    if baseline_release() in COMPILED_AT_IMPORT:
        when_loading(TARGET, _without_torch_compile)


def _gating(self, input: torch.Tensor) -> torch.Tensor:
    import torch

    router_dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(
        self.config.moe_router_dtype, input.dtype
    )
    return module(TARGET).router_gating_linear(input, self.weight, self.bias, router_dtype)


def apply() -> bool:
    if not cuda_absent():
        return False
    replace(module(TARGET).Router, "gating", _gating)
    return True
