"""Patch for ``megatron/core/utils.py`` (megatron-core 0.16.1, 0.19.2), CPU only.

What: ``GlobalMemoryBuffer.get_tensor`` allocates on the current device instead of
``torch.cuda.current_device()``.
Why: every GPTModel forward reaches the buffer (sequence-parallel gathers, attention), and on a
machine without CUDA ``torch.cuda.current_device()`` raises "Torch not compiled with CUDA".
"""

from __future__ import annotations

import operator
from contextlib import nullcontext
from functools import reduce

from ._patching import cuda_absent, module, replace

TARGET = "megatron.core.utils"
#: The supported megatron-core releases this patch applies to.
VERSIONS = ("0.16.1", "0.19.2")


def _get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
    import torch

    required_len = reduce(operator.mul, tensor_shape, 1)
    buf = self.buffer.get((name, dtype))
    if buf is None or buf.numel() < required_len:
        with (mem_alloc_context or nullcontext)():
            buf = torch.empty(required_len, dtype=dtype, device="cpu", requires_grad=False)
        self.buffer[(name, dtype)] = buf
    return buf[0:required_len].view(*tensor_shape)


def apply() -> bool:
    if not cuda_absent():
        return False
    replace(module(TARGET).GlobalMemoryBuffer, "get_tensor", _get_tensor)
    return True
