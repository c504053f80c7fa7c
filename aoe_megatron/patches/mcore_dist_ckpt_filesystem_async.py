"""Patch for ``megatron/core/dist_checkpointing/strategies/filesystem_async.py`` (0.16.1, 0.19.2), CPU only.

What: ``FileSystemWriterAsync.preload_tensors`` copies tensors to host memory without
``torch.cuda.synchronize()``.
Why: every (synchronous) ``dist_checkpointing.save`` stages tensors through this function, which
ends in ``torch.cuda.synchronize()``; without CUDA that raises, so no checkpoint can be written.
The CPU copy is already complete when ``.to("cpu")`` returns.
"""

from __future__ import annotations

from ._patching import cuda_absent, module, replace

TARGET = "megatron.core.dist_checkpointing.strategies.filesystem_async"
#: The supported megatron-core releases this patch applies to.
VERSIONS = ("0.16.1", "0.19.2")


def _preload_tensors(write_buckets, non_blocking=True):
    result = []
    for file_name, storage_key, (bytes_data, tensor_data) in write_buckets:
        tensor_data = [(item, tensor.to("cpu")) for item, tensor in tensor_data]
        result.append((file_name, storage_key, (bytes_data, tensor_data)))
    return result


def apply() -> bool:
    if not cuda_absent():
        return False
    replace(module(TARGET).FileSystemWriterAsync, "preload_tensors", staticmethod(_preload_tensors))
    return True
