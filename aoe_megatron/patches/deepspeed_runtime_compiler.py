"""Patch for ``deepspeed/runtime/compiler.py`` (DeepSpeed 0.19.8, the series pyproject allows), CPU
accelerator only.

What: ``compile()``, DeepSpeed's decorator factory for its own kernels, returns its
``dummy_decorator`` instead of ``torch.compile``.
Why: ZeRO stages 1 and 2 import DeepSpeed's Muon optimizer on their first gradient reduction
(``average_tensor``), and that module decorates three functions with ``torch.compile`` as it
loads, which imports Inductor's compiler: about a second of every CPU training process, for an
optimizer we never use (with ``mcore_jit``, a tiny two-step run starts 1.0 to 1.4 s sooner).
Were those functions run on the CPU, Inductor would compile them with the host's C++ compiler;
eager PyTorch computes the same thing.
"""

from __future__ import annotations

from ._patching import module, replace

TARGET = "deepspeed.runtime.compiler"


def apply() -> bool:
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return False
    target = module(TARGET)
    if not (hasattr(target, "compile") and hasattr(target, "dummy_decorator")):
        raise RuntimeError(f"{TARGET} has no compile/dummy_decorator: review "
                           f"patches/deepspeed_runtime_compiler.py against this DeepSpeed release")
    dummy = target.dummy_decorator
    replace(target, "compile", lambda: dummy)
    return True
