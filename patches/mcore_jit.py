"""Patch for ``megatron/core/jit.py`` (megatron-core 0.16.1), CPU only.

What: ``jit_fuser`` is megatron-core's own ``noop_decorator`` (its ``disable_jit_fuser()``) from the
moment ``megatron.core.jit`` has loaded, before any module that decorates with it.
Why: megatron-core sets ``jit_fuser = torch.compile`` as that module loads, and its modules
decorate 41 functions with it as they load (fused bias-GeLU/SwiGLU/GeGLU, cross-entropy pieces,
the router's expert-bias helper, ...). Building those TorchDynamo wrappers imports Inductor's
compiler: about a second of every CPU process's start (with ``deepspeed_runtime_compiler``, a tiny
two-step training run starts 1.0 to 1.4 s sooner), for kernels meant for GPUs. A decorated
function that did run on the CPU would be compiled by Inductor with the host's C++ compiler
(seconds per shape, and a compiler needed); eager PyTorch computes the same thing.
When: the decorations happen while megatron-core imports, so :func:`apply_patches` (at process
group start) comes too late. :func:`arm`, called by ``import aoe_megatron``, adds an import hook
that throws megatron-core's switch right after ``megatron.core.jit`` executes, where CUDA is absent
(checked then). Where megatron-core was imported before aoe_megatron, :func:`apply` still throws
it, for whatever is decorated later.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

from ._patching import cuda_absent, module, replace

TARGET = "megatron.core.jit"


def _check(jit) -> None:
    if not (hasattr(jit, "noop_decorator") and hasattr(jit, "disable_jit_fuser")):
        raise RuntimeError(f"{TARGET} has no noop_decorator/disable_jit_fuser: review "
                           f"patches/mcore_jit.py against this megatron-core release")


class _AfterJitLoads(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.jit`` as Python would, and disables its fuser once it has run."""

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # one use; also keeps PathFinder below from finding us again
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not cuda_absent():
            return spec
        run_module = spec.loader.exec_module

        def exec_module(jit):
            run_module(jit)
            _check(jit)
            jit.disable_jit_fuser()  # megatron-core's own switch; revert_patches leaves it thrown

        spec.loader.exec_module = exec_module
        return spec


def arm() -> None:
    """Disable megatron-core's jit fuser as it loads (on a machine without CUDA). Does nothing
    where megatron-core is already imported, or the hook is already in place."""
    if TARGET in sys.modules or any(isinstance(f, _AfterJitLoads) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _AfterJitLoads())


def apply() -> bool:
    if not cuda_absent():
        return False
    jit = module(TARGET)
    _check(jit)
    if jit.jit_fuser is not jit.noop_decorator:
        replace(jit, "jit_fuser", jit.noop_decorator)
    return True
