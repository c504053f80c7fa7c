"""Patch for ``deepspeed/comm/torch.py`` (DeepSpeed 0.19.8, the series pyproject allows), CPU
accelerator only.

What: ``build_shm_op`` returns None, so ``TorchBackend`` starts without DeepSpeed's shared-memory
all-reduce op.
Why: on the CPU accelerator every ``deepspeed.init_distributed`` JIT-compiles that C++ op
(``deepspeed_shm_comm``, into ``~/.cache/torch_extensions``): about 35 s with a C++ compiler on
the first run of a machine, again for every other virtualenv or checkout path (the build file
names them), ranks queueing on the build lock, and a failed start where there is no compiler.
The op serves only ``inference_all_reduce``, which we never call and which falls back to
``torch.distributed.all_reduce`` without it; training's collectives never use it.
"""

from __future__ import annotations

from ._patching import module, replace

TARGET = "deepspeed.comm.torch"


def _build_shm_op():
    return None


def apply() -> bool:
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return False
    target = module(TARGET)
    if not hasattr(target, "build_shm_op"):
        raise RuntimeError(f"{TARGET} has no build_shm_op: review patches/deepspeed_comm_torch.py "
                           f"against this DeepSpeed release")
    replace(target, "build_shm_op", _build_shm_op)
    return True
