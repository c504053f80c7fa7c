"""Patch for ``megatron/core/tensor_parallel/random.py`` (megatron-core 0.16.1, 0.19.2), CPU only.

What: the "CUDA" RNG states tracker (dropout and initialisation under model parallelism) and
activation recompute keep and swap the CPU generator's state instead of CUDA's.
Why: ``CudaRNGStatesTracker.add`` calls ``torch.cuda.get_rng_state`` and ``fork`` /
``CheckpointFunction`` call ``_get_cuda_rng_state`` / ``_set_cuda_rng_state``; every forward
(and ``model_parallel_cuda_manual_seed``) fails on a machine without CUDA.
On the CPU the tracked generator *is* the CPU generator, so ``fork``'s warning "CPU RNG state
changed within GPU RNG context" is expected there and is filtered out of that module's logger.
"""

from __future__ import annotations

import logging

from ._patching import cuda_absent, module, replace

TARGET = "megatron.core.tensor_parallel.random"
#: The supported megatron-core releases this patch applies to.
VERSIONS = ("0.16.1", "0.19.2")


def _get_rng_state(device="cuda", clone=False, graph_safe=False):
    import torch

    return torch.get_rng_state()


def _set_rng_state(new_state, device=-1, graph_safe=False):
    import torch

    torch.set_rng_state(new_state)


def _add(self, name, seed):
    import torch

    self._is_initialized = True
    if seed in self.seeds_:
        raise Exception(f"seed {seed} already exists")
    self.seeds_.add(seed)
    if name in self.states_:
        raise Exception(f"rng state {name} already exists")
    orig = torch.get_rng_state()
    torch.default_generator.manual_seed(seed)
    self.states_[name] = torch.get_rng_state()
    torch.set_rng_state(orig)


class _DropForkWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


_FILTER = _DropForkWarning()


def apply() -> bool:
    if not cuda_absent():
        return False
    mod = module(TARGET)
    replace(mod, "_get_cuda_rng_state", _get_rng_state)
    replace(mod, "_set_cuda_rng_state", _set_rng_state)
    replace(mod.CudaRNGStatesTracker, "add", _add)
    logger = logging.getLogger(TARGET)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    return True
