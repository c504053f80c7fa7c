"""Patch for ``megatron/core/jit.py`` (megatron-core 0.16.1, 0.19.2), CPU only.

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

from ._patching import cuda_absent, module, replace, when_loading

TARGET = "megatron.core.jit"
#: The supported megatron-core releases this patch applies to.
VERSIONS = ("0.16.1", "0.19.2")


def _check(jit) -> None:
    if not (hasattr(jit, "noop_decorator") and hasattr(jit, "disable_jit_fuser")):
        raise RuntimeError(f"{TARGET} has no noop_decorator/disable_jit_fuser: review "
                           f"patches/mcore_jit.py against this megatron-core release")


def _disable_fuser_after(run_module):
    def exec_module(jit):
        run_module(jit)
        if cuda_absent():
            _check(jit)
            jit.disable_jit_fuser()  # megatron-core's own switch; revert_patches leaves it thrown
    return exec_module


def arm() -> None:
    """Disable megatron-core's jit fuser as it loads (on a machine without CUDA). Does nothing
    where megatron-core is already imported, or the hook is already in place."""
    when_loading(TARGET, _disable_fuser_after)


def apply() -> bool:
    if not cuda_absent():
        return False
    jit = module(TARGET)
    _check(jit)
    if jit.jit_fuser is not jit.noop_decorator:
        replace(jit, "jit_fuser", jit.noop_decorator)
    return True
