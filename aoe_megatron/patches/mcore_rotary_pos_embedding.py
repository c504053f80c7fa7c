"""Patch for ``megatron/core/models/common/embeddings/rotary_pos_embedding.py`` (0.16.1, 0.19.2), CPU only.

What: ``RotaryEmbedding.get_emb`` leaves ``inv_freq`` where it is.
Why: upstream moves a CPU ``inv_freq`` to ``torch.cuda.current_device()`` at the first forward;
every RoPE model (ours are Llama-style) fails there without CUDA. The rest of the function is
upstream's, unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._patching import cuda_absent, module, replace

if TYPE_CHECKING:
    import torch

TARGET = "megatron.core.models.common.embeddings.rotary_pos_embedding"
#: The supported megatron-core releases this patch applies to.
VERSIONS = ("0.16.1", "0.19.2")


def _get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    import torch

    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    if not self.rotary_interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    return emb[:, None, None, :]


def apply() -> bool:
    if not cuda_absent():
        return False
    replace(module(TARGET).RotaryEmbedding, "get_emb", _get_emb)
    return True
