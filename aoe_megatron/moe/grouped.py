"""Grouped GEMMs over this rank's local experts: rows grouped by expert, one weight per expert.

A ``Groups`` object knows how many rows each local expert has and computes, for every expert l
at once, ``x_l @ w[l]`` (``mm``), ``x_l @ w[l]^T`` (``mm_t``) and the weight gradient
``x_l^T @ dy_l`` (``wgrad``; its ``name`` says which weight, for backends that write each
expert's gradient straight into the stacked gradient). Activations live in the object's layout between ``pack`` and
``unpack``; elementwise math works in any layout (padding rows are zeros and stay zeros).

Backends:
    loop        one GEMM per expert, written into one output (no padding, no copies)
    padded      one batched GEMM over [L, M, .], M the busiest expert's rows (zero padding)
    grouped_mm  ``torch._grouped_mm`` with group offsets (CUDA grouped kernels; CPU fallback)

Shape suffixes: N rows grouped by expert, L local experts, M rows of the busiest expert,
A and B a GEMM's input and output widths.
"""

from __future__ import annotations

from typing import Sequence

import torch

BACKENDS = ("loop", "padded", "grouped_mm")


class Dense:
    """One expert's GEMMs on 2-D tensors: the operations the ``loop`` backend runs per expert.

    ``out``: where a backend with ``accepts_out`` writes the product (scratch memory reused).
    """

    accepts_out = True

    @staticmethod
    def mm(x_NA: torch.Tensor, w_AB: torch.Tensor, out=None) -> torch.Tensor:
        return torch.mm(x_NA, w_AB, out=out) if out is not None else x_NA @ w_AB

    @staticmethod
    def mm_t(x_NB: torch.Tensor, w_AB: torch.Tensor, out=None) -> torch.Tensor:
        return Dense.mm(x_NB, w_AB.t(), out=out)

    @staticmethod
    def wgrad(x_NA: torch.Tensor, dy_NB: torch.Tensor, name=None) -> torch.Tensor:
        return x_NA.t() @ dy_NB


class LoopGroups:
    """Rows stay [N, .]; the whole expert (GEMMs and elementwise math) runs one expert at a time.

    NOTE: on CPUs this keeps each expert's [rows, d_wide] intermediates in cache between the
    GEMM that makes them and the elementwise math that uses them; one pass over all N rows at
    once is memory-bound there (measured by ``make bench``).
    """

    name = "loop"
    per_group = True

    def __init__(self, counts: Sequence[int]):
        self.counts = [int(c) for c in counts]
        ends, total = [], 0
        for c in self.counts:
            total += c
            ends.append(total)
        self.bounds = [(end - c, end) for c, end in zip(self.counts, ends)]


class PaddedGroups:
    """Rows padded to [L, M, .] (M: the busiest expert's rows); batched GEMMs over experts.

    NOTE: when every expert has the same number of rows the layout is a plain view, no copy.
    """

    name = "padded"
    per_group = False
    accepts_out = True

    def __init__(self, counts: Sequence[int], device: torch.device):
        self.counts = [int(c) for c in counts]
        self.num_groups = len(self.counts)
        self.rows = max(self.counts, default=0)
        self.balanced = all(c == self.rows for c in self.counts)
        if not self.balanced:
            counts_L = torch.tensor(self.counts, device=device)
            starts_L = torch.cumsum(counts_L, 0) - counts_L
            group_N = torch.repeat_interleave(torch.arange(self.num_groups, device=device), counts_L)
            within_N = torch.arange(int(counts_L.sum()), device=device) - starts_L[group_N]
            self.slot_N = group_N * self.rows + within_N

    def pack(self, t_N: torch.Tensor) -> torch.Tensor:
        shape = (self.num_groups, self.rows, *t_N.shape[1:])
        if self.balanced:
            return t_N.reshape(shape)
        buf = t_N.new_zeros(self.num_groups * self.rows, *t_N.shape[1:])
        return buf.index_copy_(0, self.slot_N, t_N).view(shape)

    def unpack(self, t_LM: torch.Tensor) -> torch.Tensor:
        flat = t_LM.reshape(self.num_groups * self.rows, *t_LM.shape[2:])
        return flat if self.balanced else flat.index_select(0, self.slot_N)

    @staticmethod
    def mm(x_LMA: torch.Tensor, w_LAB: torch.Tensor, out=None) -> torch.Tensor:
        return torch.bmm(x_LMA, w_LAB, out=out)

    @staticmethod
    def mm_t(x_LMB: torch.Tensor, w_LAB: torch.Tensor, out=None) -> torch.Tensor:
        return torch.bmm(x_LMB, w_LAB.transpose(1, 2), out=out)

    @staticmethod
    def wgrad(x_LMA: torch.Tensor, dy_LMB: torch.Tensor, name=None) -> torch.Tensor:
        return torch.bmm(x_LMA.transpose(1, 2), dy_LMB)


class GroupedMMGroups:
    """``torch._grouped_mm`` over [N, .] rows with group end offsets."""

    name = "grouped_mm"
    per_group = False
    accepts_out = False

    def __init__(self, counts: Sequence[int], device: torch.device):
        self.counts = [int(c) for c in counts]
        self.empty = [l for l, c in enumerate(self.counts) if c == 0]
        ends = torch.cumsum(torch.tensor(self.counts, dtype=torch.int64), 0)
        self.offs_L = ends.to(device=device, dtype=torch.int32)

    @staticmethod
    def pack(t_N: torch.Tensor) -> torch.Tensor:
        return t_N

    @staticmethod
    def unpack(t_N: torch.Tensor) -> torch.Tensor:
        return t_N

    def mm(self, x_NA: torch.Tensor, w_LAB: torch.Tensor, out=None) -> torch.Tensor:
        assert out is None, "torch._grouped_mm has no out= form"
        return torch._grouped_mm(_aligned(x_NA), w_LAB, offs=self.offs_L)

    def mm_t(self, x_NB: torch.Tensor, w_LAB: torch.Tensor, out=None) -> torch.Tensor:
        return self.mm(x_NB, w_LAB.transpose(-2, -1), out=out)

    def wgrad(self, x_NA: torch.Tensor, dy_NB: torch.Tensor, name=None) -> torch.Tensor:
        """[L, A, B]; zero for experts without rows.

        NOTE: empty experts are guarded here, not left to the kernel: with no rows at all (a rank
        whose experts received no tokens) the contraction length is 0 and CUDA's
        ``_grouped_mm`` rejects the operand's strides; a single empty group has been reported
        to come back non-zero on some GPUs (pytorch/pytorch#172439).
        """
        num_groups = len(self.counts)
        if sum(self.counts) == 0:
            return x_NA.new_zeros(num_groups, x_NA.shape[1], dy_NB.shape[1])
        out_LAB = torch._grouped_mm(_aligned(x_NA).t(), _aligned(dy_NB), offs=self.offs_L)
        if self.empty:
            out_LAB[self.empty] = 0
        return out_LAB


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """A view whose row stride and start are 16-byte aligned (``_grouped_mm`` needs both)."""
    size = t.element_size()
    if (t.stride(0) * size) % 16 or (t.data_ptr() % 16):
        return t.contiguous()
    return t


def grouped_mm_supports(dtype: torch.dtype, widths: Sequence[int], device: torch.device) -> bool:
    """Whether ``torch._grouped_mm`` can run these GEMMs: the op exists, the dtype is one it
    takes (bf16 only on CUDA), and every width is a multiple of 16 bytes."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    allowed = (torch.bfloat16,) if device.type == "cuda" else (torch.float32, torch.bfloat16, torch.float16)
    if dtype not in allowed:
        return False
    size = torch.empty((), dtype=dtype).element_size()
    return all((w * size) % 16 == 0 for w in widths)


def auto_backend(*, device: torch.device, dtype: torch.dtype, widths: Sequence[int]) -> str:
    """The backend "auto" picks.

    CUDA: ``grouped_mm`` where it applies (bf16, aligned widths), else ``loop``.
    CPU: ``loop``: it beat ``padded`` and ``grouped_mm`` at every shape ``make bench`` measured
    (bench/README.md): one expert at a time keeps its intermediates in cache, while padding
    adds rows and whole-layer elementwise passes are memory-bound.
    """
    if device.type == "cuda" and grouped_mm_supports(dtype, widths, device):
        return "grouped_mm"
    return "loop"


def make_groups(counts: Sequence[int], *, backend: str, device: torch.device,
                dtype: torch.dtype, widths: Sequence[int]):
    """The ``Groups`` for ``backend`` ("auto" resolved by ``auto_backend``)."""
    if backend == "auto":
        backend = auto_backend(device=device, dtype=dtype, widths=widths)
    if backend == "loop":
        return LoopGroups(counts)
    if backend == "padded":
        return PaddedGroups(counts, device)
    if backend == "grouped_mm":
        if not grouped_mm_supports(dtype, widths, device):
            raise ValueError(
                f"expert_backend 'grouped_mm' cannot run {dtype} GEMMs of widths {list(widths)} on "
                f"{device.type}: torch._grouped_mm needs bf16 on CUDA (fp32/bf16/fp16 on CPU) and "
                f"every width a multiple of 16 bytes; use 'auto' or 'loop'."
            )
        return GroupedMMGroups(counts, device)
    raise ValueError(f"unknown grouped GEMM backend {backend!r}; choose one of {BACKENDS} or 'auto'")
