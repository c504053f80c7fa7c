"""Changes aoe-megatron makes to upstream engines, one module per upstream file.

megatron-core calls CUDA unconditionally in a few places. On a machine without CUDA (our CPU test
machines, CI) those calls fail, so each is replaced by a device-neutral version. The patches are
applied by one explicit call, :func:`apply_patches`; nothing is patched on import, with one
exception: megatron-core wraps some kernels in ``torch.compile`` and imports wandb while it
imports, so ``import aoe_megatron`` calls :func:`arm` (import hooks) before any megatron-core
module loads.

Each module here:
  - names the upstream file it changes (``TARGET``) and says what, why and for which versions;
  - declares the supported megatron-core releases it applies to (``VERSIONS``, a subset of
    ``runtime.versions.SUPPORTED_MCORE``): it is off for the others, whose release no longer
    needs it (``tests/test_patches.py`` shows, on each CI leg, that an active patch is needed and
    an inactive one is not);
  - exposes ``apply() -> bool`` returning whether it changed anything on this machine.

CPU patches apply only when CUDA is absent; ``mcore_moe_utils`` applies whenever TransformerEngine
is absent (a NameError on GPUs too, 0.16.1); the checkpoint writer's (``mcore_dist_ckpt_results_queue``,
``mcore_dist_ckpt_write_digests``) on every device. DeepSpeed's patches (``deepspeed_*``) apply through
:func:`apply_deepspeed_patches`, once DeepSpeed is imported.

No module here imports torch as it loads (each imports it inside its functions), so
``import aoe_megatron`` does not load torch: every command's ``--help`` answers at once.
"""

from __future__ import annotations

import os

from . import (
    deepspeed_comm_torch,
    deepspeed_runtime_compiler,
    mcore_dist_ckpt_filesystem_async,
    mcore_dist_ckpt_results_queue,
    mcore_dist_ckpt_state_dict_saver,
    mcore_dist_ckpt_write_digests,
    mcore_jit,
    mcore_moe_router,
    mcore_moe_token_dispatcher,
    mcore_moe_utils,
    mcore_rotary_pos_embedding,
    mcore_tensor_parallel_mappings,
    mcore_tensor_parallel_random,
    mcore_transformer_utils,
    mcore_utils,
    mcore_wandb_import,
)
from ._patching import revert_all
from aoe_megatron.runtime.versions import baseline_release

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
    mcore_dist_ckpt_write_digests,
    mcore_wandb_import,
)

#: DeepSpeed's, applied by :func:`apply_deepspeed_patches` when DeepSpeed is imported (processes
#: that never train do not import it).
DEEPSPEED_PATCHES = (deepspeed_comm_torch, deepspeed_runtime_compiler)

_applied: list[str] | None = None
_applied_deepspeed: list[str] | None = None


def applies(patch, release: str | None = None) -> bool:
    """Whether ``patch`` is on for ``release`` (default: the supported release the installed
    megatron-core follows, ``runtime.versions.baseline_release``)."""
    return (release or baseline_release()) in patch.VERSIONS


def active_patches(release: str | None = None) -> tuple:
    """The megatron-core patches on for ``release`` (default: the installed one's)."""
    return tuple(p for p in ALL_PATCHES if applies(p, release))


def arm() -> None:
    """Import hooks for what megatron-core does while it imports (``mcore_jit``,
    ``mcore_moe_router``, ``mcore_wandb_import``); ``import aoe_megatron`` calls this before
    megatron-core loads."""
    for patch in active_patches():
        if hasattr(patch, "arm"):
            patch.arm()


def apply_patches() -> list[str]:
    """Apply every patch this machine needs, once. Returns the names of the patches applied."""
    global _applied
    if _applied is not None:
        return list(_applied)
    _applied = [p.__name__.split(".")[-1] for p in active_patches() if p.apply()]
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
