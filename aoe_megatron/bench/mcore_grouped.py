"""megatron-core's own grouped-GEMM MoE experts as a benchmark arm (``moe-grouped``).

The ``moe`` arm is megatron-core's MoE layer as the stock local spec builds it: ``SequentialMLP``,
a Python loop over experts. Its grouped-GEMM counterpart is the fair baseline for AoE's
``torch._grouped_mm`` experts:

- megatron-core 0.16.1: the legacy ``GroupedMLP`` (the local spec with ``moe_grouped_gemm=True``).
  It calls only ``grouped_gemm.ops.gmm(a, b, batch_sizes, trans_b)`` through
  ``megatron.core.transformer.moe.grouped_gemm_util``; the ``grouped_gemm`` package is not
  installed, so ``installed()`` puts ``gmm`` below (over ``torch._grouped_mm``) where that module
  looks, for the benchmark only, and restores it after.
- megatron-core 0.19.2 has no ``GroupedMLP`` (its local spec maps the grouped option to
  ``SequentialMLP``): ``TEGroupedMLP`` stands in when the run uses TransformerEngine, else the arm
  is unavailable and says why (``unavailable_reason``); it never falls back to ``SequentialMLP``.

``gmm`` runs ``torch._grouped_mm`` on CPU and CUDA alike, never a per-group loop: on the CPU it
takes fp32, bf16 and fp16 (checked with torch 2.11 and 2.13), on CUDA bf16; every width must be
a multiple of 16 bytes (``moe.grouped.grouped_mm_supports``), else it refuses.

Shape suffixes: N rows grouped by expert, L local experts, A and B a GEMM's input and output
widths, D d_model, F d_ffn.
"""

from __future__ import annotations

import contextlib
import copy
import types

import torch

from aoe_megatron.moe.grouped import GroupedMMGroups, grouped_mm_supports
from aoe_megatron.runtime.versions import installed_mcore


class _GroupedGemm(torch.autograd.Function):
    """y_l = a_l @ b[l] (``trans_b``: a_l @ b[l]^T) for each group l of rows, with its backward:
    da_l = dy_l @ b[l]^T (``trans_b``: dy_l @ b[l]), db[l] = a_l^T dy_l (``trans_b``: dy_l^T a_l).
    Weight gradients of empty groups are zero (``GroupedMMGroups.wgrad``'s guard)."""

    @staticmethod
    def forward(ctx, a_NA, b_LAB, counts: list[int], trans_b: bool):
        groups = GroupedMMGroups(counts, a_NA.device)
        ctx.groups, ctx.trans_b = groups, trans_b
        ctx.save_for_backward(a_NA, b_LAB)
        if a_NA.shape[0] == 0:  # no rows at all: nothing for the kernel to do
            return a_NA.new_zeros(0, b_LAB.shape[1] if trans_b else b_LAB.shape[2])
        return groups.mm_t(a_NA, b_LAB) if trans_b else groups.mm(a_NA, b_LAB)

    @staticmethod
    def backward(ctx, dy_NB):
        a_NA, b_LAB = ctx.saved_tensors
        groups, trans_b = ctx.groups, ctx.trans_b
        da = db = None
        if ctx.needs_input_grad[0]:
            if a_NA.shape[0] == 0:
                da = torch.zeros_like(a_NA)
            else:
                da = groups.mm(dy_NB, b_LAB) if trans_b else groups.mm_t(dy_NB, b_LAB)
        if ctx.needs_input_grad[1]:
            db = groups.wgrad(dy_NB, a_NA) if trans_b else groups.wgrad(a_NA, dy_NB)
        return da, db, None, None


def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor,
        trans_b: bool = False) -> torch.Tensor:
    """``grouped_gemm.ops.gmm``'s contract over ``torch._grouped_mm``: ``a`` [N, A] rows grouped
    by expert, ``batch_sizes`` [L] rows per group (group end offsets are their cumulative sum),
    ``b`` [L, A, B] (``trans_b``: [L, B, A]); returns [N, B]."""
    counts = [int(c) for c in batch_sizes.tolist()]
    if len(counts) != b.shape[0] or sum(counts) != a.shape[0]:
        raise ValueError(f"gmm: {len(counts)} groups of {sum(counts)} rows for a {tuple(a.shape)} "
                         f"and b {tuple(b.shape)}")
    width_in, width_out = (b.shape[2], b.shape[1]) if trans_b else (b.shape[1], b.shape[2])
    if a.shape[1] != width_in:
        raise ValueError(f"gmm: a is {a.shape[1]} wide, b (trans_b={trans_b}) takes {width_in}")
    if not grouped_mm_supports(a.dtype, (width_in, width_out), a.device):
        raise ValueError(f"gmm: torch._grouped_mm cannot run {a.dtype} widths "
                         f"({width_in}, {width_out}) on {a.device.type} (bf16 only on CUDA; every "
                         "width a multiple of 16 bytes)")
    return _GroupedGemm.apply(a, b, counts, trans_b)


@contextlib.contextmanager
def installed():
    """Make megatron-core's ``grouped_gemm_util`` see ``gmm`` as ``grouped_gemm.ops.gmm`` (what
    ``GroupedMLP`` checks at construction and calls in forward), and restore it on exit. Build and
    run the ``GroupedMLP`` layers inside."""
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    saved = gg.grouped_gemm, gg.ops
    ops = types.SimpleNamespace(gmm=gmm)
    gg.grouped_gemm, gg.ops = types.SimpleNamespace(ops=ops, __name__="aoe_megatron gmm"), ops
    try:
        yield
    finally:
        gg.grouped_gemm, gg.ops = saved


def legacy_grouped_mlp():
    """megatron-core's legacy ``GroupedMLP`` class, or None where the release has none (0.17+)."""
    from megatron.core.transformer.moe import experts

    return getattr(experts, "GroupedMLP", None)


def unavailable_reason(*, d_model: int, d_ffn: int, device: str, dtype: torch.dtype,
                       use_te: bool) -> str | None:
    """Why the ``moe-grouped`` arm cannot run here, or None when it can."""
    if legacy_grouped_mlp() is None:
        if use_te:
            return None  # TEGroupedMLP stands in
        return (f"megatron-core {installed_mcore()} has no legacy GroupedMLP (its local spec maps "
                "moe_grouped_gemm to SequentialMLP) and this run does not use TransformerEngine, "
                "whose TEGroupedMLP would stand in")
    widths = (d_model, d_ffn, 2 * d_ffn)
    if not grouped_mm_supports(dtype, widths, torch.device(device)):
        return (f"GroupedMLP through torch._grouped_mm cannot run {dtype} widths {widths} on "
                f"{device}")
    return None


def build_grouped_moe(tc, *, device: str, use_te: bool):
    """megatron-core's MoE layer with grouped-GEMM experts (``GroupedMLP``, or ``TEGroupedMLP``
    on a release without it), the router as the ``moe`` arm's. Build it inside ``installed()``."""
    from dataclasses import replace

    from aoe_megatron.models.spec import (  # deferred: megatron-core loads at build
        build, moe_layer_spec, moe_submodules)
    from aoe_megatron.models.stock_router import (  # deferred: megatron-core loads at build
        PaperTopKRouter)

    grouped_cls = legacy_grouped_mlp()
    tc = replace(tc, moe_grouped_gemm=True)
    if grouped_cls is None:  # TEGroupedMLP, as the moe arm has it with TE (unavailable_reason)
        spec = moe_layer_spec(tc.num_moe_experts, use_te=True)
        return build(spec.submodules.mlp, config=tc, layer_number=1).to(device)
    from megatron.core.models.gpt import gpt_layer_specs

    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=tc.num_moe_experts, moe_grouped_gemm=True, normalization="RMSNorm")
    sub = moe_submodules(spec)
    experts_cls = getattr(sub.experts, "module", sub.experts)
    if experts_cls is not grouped_cls:
        raise RuntimeError(f"megatron-core's local spec gives {experts_cls.__name__} experts for "
                           "moe_grouped_gemm=True, not GroupedMLP")
    sub.router = PaperTopKRouter  # the moe arm's router (models.spec.moe_layer_spec)
    layer = build(spec.submodules.mlp, config=tc, layer_number=1).to(device)
    if not tc.bf16:
        allow_non_bf16(layer.experts)
    return layer


def allow_non_bf16(experts) -> None:
    """Let a ``GroupedMLP`` run in fp32 or fp16 (the CPU benchmark, the fp32 test).

    NOTE: ``GroupedMLP.forward`` asserts ``config.bf16``: the ``grouped_gemm`` package's kernels
    are bf16 only. ``gmm`` runs other dtypes (on the CPU), so the experts get a copy of the config
    with ``bf16`` set; in megatron-core 0.16.1 nothing else in GroupedMLP reads that flag, and
    the layer's other modules keep the real config.
    """
    experts.config = copy.copy(experts.config)
    experts.config.bf16 = True


@torch.no_grad()
def copy_from_sequential(grouped_layer, moe_layer) -> None:
    """Give ``grouped_layer`` (``build_grouped_moe``) the weights of ``moe_layer`` (the ``moe``
    arm: ``SequentialMLP`` experts): the same router, and each expert's fc1 / fc2.

    ``GroupedMLP`` keeps weight1 [D, L * 2F] and weight2 [L * F, D], read as [L, D, 2F] and
    [L, F, D]: expert l's fc1 is ``weight1.view(L, D, 2F)[l]`` = (its linear_fc1.weight
    [2F, D])^T, its fc2 ``weight2.view(L, F, D)[l]`` = (linear_fc2.weight [D, F])^T.
    ``TEGroupedMLP`` keeps one ``weight{l}`` per expert, as linear layers do.
    """
    from aoe_megatron.models.spec import (  # deferred: megatron-core loads at build
        expert_weight_pairs)

    grouped_layer.router.load_state_dict(moe_layer.router.state_dict())
    src = expert_weight_pairs(moe_layer.experts)
    dst = grouped_layer.experts
    if hasattr(dst, "weight1"):
        w1_LDF = dst.weight1.view(len(src), dst.config.hidden_size, -1)
        w2_LFD = dst.weight2.view(len(src), -1, dst.config.hidden_size)
        for l, (fc1, fc2) in enumerate(src):
            w1_LDF[l].copy_(fc1.t())
            w2_LFD[l].copy_(fc2.t())
        return
    for (fc1, fc2), (d1, d2) in zip(src, expert_weight_pairs(dst)):
        d1.copy_(fc1)
        d2.copy_(fc2)
