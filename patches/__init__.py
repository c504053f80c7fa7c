"""Changes aoe-megatron makes to upstream engines, one module per upstream file.

megatron-core 0.16.1 calls CUDA unconditionally in a few places. On a machine without CUDA (our
CPU test machines, CI) those calls fail, so each is replaced by a device-neutral version. The
patches are applied by one explicit call, :func:`apply_patches`; nothing is patched on import,
with one exception: megatron-core decorates its fused kernels with ``torch.compile`` while it imports,
so ``import aoe_megatron`` arms ``mcore_jit`` (an import hook, :func:`mcore_jit.arm`) before any
megatron-core module loads.

Each module here:
  - names the upstream file it changes (``TARGET``) and says what, why and for which version;
  - exposes ``apply() -> bool`` returning whether it changed anything on this machine;
  - is covered by a test in ``tests/test_patches.py`` showing the patch is needed and works.

CPU patches apply only when CUDA is absent; the ``te_general_gemm`` fix applies whenever
TransformerEngine is absent (it is a NameError on GPUs too). DeepSpeed's patches (``deepspeed_*``)
apply through :func:`apply_deepspeed_patches`, once DeepSpeed is imported.
"""

from __future__ import annotations

import os

from . import (
    deepspeed_comm_torch,
    deepspeed_runtime_compiler,
    mcore_dist_ckpt_filesystem_async,
    mcore_dist_ckpt_results_queue,
    mcore_dist_ckpt_state_dict_saver,
    mcore_jit,
    mcore_moe_router,
    mcore_moe_token_dispatcher,
    mcore_moe_utils,
    mcore_rotary_pos_embedding,
    mcore_tensor_parallel_mappings,
    mcore_tensor_parallel_random,
    mcore_transformer_utils,
    mcore_utils,
)
from ._patching import revert_all

#: The megatron-core version every patch here was written against and tested with (one place:
#: ``aoe_megatron.MEGATRON_CORE_VERSION``, which ``import aoe_megatron`` checks).
from aoe_megatron import MEGATRON_CORE_VERSION as SUPPORTED_MCORE_VERSION  # noqa: E402

ALL_PATCHES = (
    mcore_jit,
    mcore_utils,
    mcore_tensor_parallel_random,
    mcore_tensor_parallel_mappings,
    mcore_moe_utils,
    mcore_moe_router,
    mcore_moe_token_dispatcher,
    mcore_rotary_pos_embedding,
    mcore_transformer_utils,
    mcore_dist_ckpt_filesystem_async,
    mcore_dist_ckpt_results_queue,
    mcore_dist_ckpt_state_dict_saver,
)

#: DeepSpeed's, applied by :func:`apply_deepspeed_patches` when DeepSpeed is imported (processes
#: that never train do not import it).
DEEPSPEED_PATCHES = (deepspeed_comm_torch, deepspeed_runtime_compiler)

_applied: list[str] | None = None
_applied_deepspeed: list[str] | None = None


def check_mcore_version() -> None:
    """Refuse a megatron-core these patches were not written for."""
    import megatron.core

    found = getattr(megatron.core, "__version__", "unknown")
    if found != SUPPORTED_MCORE_VERSION:
        raise RuntimeError(
            f"aoe-megatron's patches were written for megatron-core {SUPPORTED_MCORE_VERSION}, "
            f"but megatron-core {found} is installed. Install the pinned version "
            f"(`make setup`, see requirements.txt), or review every module in patches/ against "
            f"the new release before changing SUPPORTED_MCORE_VERSION."
        )


def apply_patches() -> list[str]:
    """Apply every patch this machine needs, once. Returns the names of the patches applied."""
    global _applied
    if _applied is not None:
        return list(_applied)
    check_mcore_version()
    _applied = [p.__name__.split(".")[-1] for p in ALL_PATCHES if p.apply()]
    if os.environ.get("AOE_VERBOSE_PATCHES"):
        print(f"aoe-megatron patches applied: {_applied}")
    return list(_applied)


def apply_deepspeed_patches() -> list[str]:
    """Apply DeepSpeed's patches this machine needs, once; DeepSpeed must be imported already
    (``train.engine.import_deepspeed`` selects its accelerator first)."""
    global _applied_deepspeed
    if _applied_deepspeed is None:
        _applied_deepspeed = [p.__name__.split(".")[-1] for p in DEEPSPEED_PATCHES if p.apply()]
    return list(_applied_deepspeed)


def revert_patches() -> None:
    """Restore megatron-core and DeepSpeed as they were (tests use this to show each patch is
    needed)."""
    global _applied, _applied_deepspeed
    revert_all()
    _applied = _applied_deepspeed = None
