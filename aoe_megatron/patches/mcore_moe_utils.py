"""Patch for ``megatron/core/transformer/moe/moe_utils.py`` (megatron-core 0.16.1), all devices.

What: define ``te_general_gemm = None`` when TransformerEngine is absent.
Why: ``moe_utils`` imports ``te_general_gemm`` only inside ``try: import transformer_engine``, yet
``RouterGatingLinearFunction`` reads it unconditionally, so the stock router's gating raises
``NameError: name 'te_general_gemm' is not defined`` on any machine without TE, GPUs included.
With ``None`` upstream takes its own ``torch.mm`` path. megatron-core 0.19.2 sets it to ``None``
itself where TE is absent: the patch is off there (``VERSIONS``).
"""

from __future__ import annotations

from ._patching import module, replace

TARGET = "megatron.core.transformer.moe.moe_utils"
#: The supported megatron-core releases this patch applies to.
VERSIONS = ("0.16.1",)


def apply() -> bool:
    mod = module(TARGET)
    if hasattr(mod, "te_general_gemm"):
        return False
    replace(mod, "te_general_gemm", None)
    return True
