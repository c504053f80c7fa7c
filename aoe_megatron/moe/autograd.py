"""Memory-lean autograd functions of the AoE layer: what backward keeps is chosen, not implied.

``cache_and_norms``: C = x W_down (Eq. 4) and p_i = ||C_i|| (Algorithm 2, line 7). Autograd would
keep the whole [T, E * R] cache for the norm's backward; this keeps x only and recomputes
x W_down there (one more GEMM of the router's size). The rows sent to experts keep their C_i.

``grouped_experts``: Eq. 3 after the cache for every local expert at once, through one
``grouped.Groups`` (loop, padded or grouped GEMMs), weighted by the selection probabilities:
    y = (SiLU(act) * lin * p) W_o,   act = C W_up, lin = x W_p   (factorization "gate", the paper)
It keeps the dispatched rows [x | C], act, lin and p: SiLU and the products are recomputed in
backward (elementwise), as megatron-core's fused SwiGLU does; with ``recompute_low_rank`` the
low-rank projection C W_up is recomputed too. Autograd's plain graph keeps SiLU(act), the
product, the scaled product and the unweighted output besides. Backend "loop" runs the whole
expert (GEMMs and elementwise math) one expert at a time in reused scratch memory and writes
each expert's weight gradient into its slot of the stacked gradient.

Shape suffixes: T tokens, N dispatched rows (grouped by expert), D d_model, E experts,
R d_low, W d_wide, L local experts. The expert math (``expert_forward``/``expert_backward``)
names tensors without suffixes: they are one expert's 2-D rows, or every expert's rows in the
groups' layout ([N, .] or padded [L, M, .]).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from aoe_megatron.moe import grouped, ops
from aoe_megatron.moe.expert_math import Grads, Scratch, Weights, expert_backward, expert_forward


class _CacheNorms(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, w_down_DER, num_experts: int, order: str):
        cache_TER = ops.low_rank_cache(x_TD, w_down_DER=w_down_DER, num_experts=num_experts)
        norms_TE = ops.expert_norms(cache_TER, order=order)
        ctx.save_for_backward(x_TD, w_down_DER)
        ctx.num_experts, ctx.order = num_experts, order
        ctx.set_materialize_grads(False)  # an unused output (cache mode "recompute") gets None
        return cache_TER, norms_TE

    @staticmethod
    def backward(ctx, d_cache_TER, d_norms_TE):
        x_TD, w_down_DER = ctx.saved_tensors
        d_cache = d_cache_TER
        if d_norms_TE is not None:
            # the cache again (one GEMM), then the norms' gradient; in place on the fresh cache
            cache_TER = ops.low_rank_cache(x_TD, w_down_DER=w_down_DER, num_experts=ctx.num_experts)
            d_from_norms = _norm_backward(cache_TER, d_norms_TE, ctx.order)
            d_cache = d_from_norms if d_cache is None else d_from_norms.add_(d_cache)
        if d_cache is None:
            return None, None, None, None
        d_cache_TX = d_cache.reshape(x_TD.shape[0], -1)
        dx = d_cache_TX @ w_down_DER.t() if ctx.needs_input_grad[0] else None
        dw = x_TD.t() @ d_cache_TX if ctx.needs_input_grad[1] else None
        return dx, dw, None, None


def _norm_backward(cache_TER: torch.Tensor, d_norms_TE: torch.Tensor, order: str) -> torch.Tensor:
    """d||C_i|| / dC_i times the incoming gradient, overwriting ``cache_TER`` where it can.

    L2: C_i * (g / ||C_i||), 0 where the norm is 0 (torch's own norm backward); L1 and L-inf go
    through autograd.
    """
    if order == "l2":
        norms_TE = ops.expert_norms(cache_TER, order="l2")
        scale_TE = (d_norms_TE / norms_TE).masked_fill_(norms_TE == 0, 0)
        return cache_TER.mul_(scale_TE.unsqueeze(-1))
    with torch.enable_grad():
        cache_TER.requires_grad_()
        norms_TE = ops.expert_norms(cache_TER, order=order)
        (d_cache,) = torch.autograd.grad(norms_TE, cache_TER, d_norms_TE)
    return d_cache


def cache_and_norms(x_TD: torch.Tensor, *, w_down_DER: torch.Tensor, num_experts: int,
                    order: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(cache_TER, norms_TE) as ``ops.low_rank_cache`` then ``ops.expert_norms``, keeping only
    x (and the weight) for backward."""
    return _CacheNorms.apply(x_TD, w_down_DER, num_experts, order)


class _Saved(NamedTuple):
    """What backward keeps of one piece of work: the rows [x | C] (or x), C when recomputed from
    x (else None: it is in the rows), act and lin (one may be None: recomputed), the probs."""

    rows: torch.Tensor
    c: Optional[torch.Tensor]
    act: Optional[torch.Tensor]
    lin: Optional[torch.Tensor]
    p: torch.Tensor


def _save(ctx, weights: Weights, pieces: list) -> None:
    """Everything backward needs through ``save_for_backward`` (none on ctx), so saved-tensor
    hooks (offloading, the benchmark's byte count) see all of it; ``_saved`` reads it back."""
    ctx.save_for_backward(*weights, *[t for piece in pieces for t in piece])


def _saved(ctx) -> tuple:
    """(weights, [_Saved per piece]) as ``_save`` stored them."""
    flat = ctx.saved_tensors
    n_w, n_s = len(Weights._fields), len(_Saved._fields)
    pieces = [_Saved(*flat[i : i + n_s]) for i in range(n_w, len(flat), n_s)]
    return Weights(*flat[:n_w]), pieces


_INPUTS = Grads._fields  # _GroupedExperts's differentiable inputs, in order


class _GroupedExperts(torch.autograd.Function):
    """Saved: the rows [x | C] (or x, and C recomputed here), act and lin (C W_up left out with
    ``recompute_low_rank``), the probabilities. Per expert (backend "loop": one slice each) or
    in the groups' layout (padded, grouped_mm)."""

    @staticmethod
    def forward(ctx, rows_NX, w_down_LDR, w_up, w_p, w_o, probs_N, groups, d_model: int,
                factorized: str, recompute_low_rank: bool):
        drop = recompute_low_rank and factorized != "none"
        weights = Weights(w_down_LDR, w_up, w_p, w_o)
        scratch = Scratch(max(groups.counts, default=0) if groups.per_group else None)
        out_ND = rows_NX.new_empty(rows_NX.shape[0], d_model) if groups.per_group else None
        outs, pieces = [], []
        for sl, mm, (wd, wu, wp, wo) in _pieces(groups, weights):
            rows = _layout(groups, rows_NX)[sl]
            x = rows[..., :d_model]
            c = (rows[..., d_model:] if wd is None else mm.mm(x, wd)).to(x.dtype)
            p = _layout(groups, probs_N)[sl].unsqueeze(-1)
            out, act, lin = expert_forward(mm, scratch, x, c, wu, wp, wo, p, factorized,
                                            out=None if out_ND is None else out_ND[sl])
            if drop:  # recomputed in backward from C
                act, lin = (None, lin) if factorized == "gate" else (act, None)
            outs.append(out)
            pieces.append(_Saved(rows, c if wd is not None else None, act, lin, p))
        _save(ctx, weights, pieces)
        ctx.groups, ctx.d_model, ctx.factorized, ctx.drop = groups, d_model, factorized, drop
        ctx.rows_shape = rows_NX.shape
        if groups.per_group:
            return out_ND
        return groups.unpack(outs[0])

    @staticmethod
    def backward(ctx, d_out_ND):
        weights, saved = _saved(ctx)
        groups, fac = ctx.groups, ctx.factorized
        need = dict(zip(_INPUTS, ctx.needs_input_grad))
        # backend "loop": each expert's weight gradient is written straight into its slot
        wgrads = {name: torch.empty_like(w) for name, w in weights._asdict().items()
                  if w is not None and need[name]} if groups.per_group else {}
        scratch = Scratch(max(groups.counts, default=0) if groups.per_group else None)
        per = groups.per_group
        d_rows = d_out_ND.new_empty(ctx.rows_shape) if per and need["rows"] else None
        d_probs = (d_out_ND.new_zeros(ctx.rows_shape[0], dtype=saved[0].p.dtype)
                   if per and saved else None)
        dy_all = _layout(groups, d_out_ND)
        for piece, (sl, mm, w) in zip(saved, _pieces(groups, weights, wgrads)):
            x = piece.rows[..., : ctx.d_model]
            c = piece.rows[..., ctx.d_model :] if piece.c is None else piece.c
            act, lin = piece.act, piece.lin
            if ctx.drop:  # the low-rank projection C W_up, recomputed
                low = mm.mm(c, w.w_up)
                act, lin = (low, lin) if fac == "gate" else (act, low)
            grads = expert_backward(mm, scratch, dy_all[sl], x, c, act, lin, piece.p, w,
                                     factorized=fac, need=need,
                                     d_rows=None if d_rows is None else d_rows[sl])
            if per:
                if grads.probs is not None:
                    d_probs[sl] = grads.probs
            else:
                d_rows = groups.unpack(grads.rows) if need["rows"] else None
                d_probs = groups.unpack(grads.probs) if need["probs"] else None
                wgrads.update((name, g) for name, g in grads._asdict().items()
                              if name in weights._fields and g is not None)
        if per:
            busy = {l for l, _ in _busy(groups)}
            for w in wgrads.values():  # experts without rows
                for l in range(w.shape[0]):
                    if l not in busy:
                        w[l].zero_()
            if d_rows is not None and not busy:
                d_rows.zero_()
        out = [wgrads.get(name) for name in _INPUTS]
        out[0] = d_rows if need["rows"] else None
        out[5] = d_probs if need["probs"] else None
        return (*out, None, None, None, None)


def _busy(groups):
    """(local expert, row slice) of each expert with rows (backend "loop")."""
    return [(l, slice(s, e)) for l, (s, e) in enumerate(groups.bounds) if e > s]


class _ExpertSlot(grouped.Dense):
    """Backend "loop": one expert's GEMMs; weight gradients land in that expert's slot of the
    stacked gradient (no copy)."""

    def __init__(self, expert: int, wgrads: dict):
        self.expert, self.wgrads = expert, wgrads

    def wgrad(self, x_NA, dy_NB, name=None):
        if name in self.wgrads:
            return torch.mm(x_NA.t(), dy_NB, out=self.wgrads[name][self.expert])
        return x_NA.t() @ dy_NB


def _pieces(groups, weights, wgrads=None):
    """(row slice, GEMMs, weights) per piece of work: each busy expert (loop: 2-D slices of the
    stacked weights), or everything at once in the groups' layout."""
    if groups.per_group:
        return [(sl, _ExpertSlot(l, wgrads or {}),
                 Weights(*(None if w is None else w[l] for w in weights))) for l, sl in _busy(groups)]
    return [(slice(None), groups, weights)]


def _layout(groups, t_N):
    return t_N if groups.per_group else groups.pack(t_N)


def grouped_experts(rows_NX: torch.Tensor, *, probs_N: torch.Tensor, groups, d_model: int,
                    w_up: torch.Tensor, w_p: torch.Tensor, w_o: torch.Tensor,
                    w_down_LDR: Optional[torch.Tensor] = None, factorized: str = "gate",
                    recompute_low_rank: bool = False) -> torch.Tensor:
    """probs * E_i(x) for every dispatched row, [N, D].

    ``rows_NX`` is [x | C_i] ([N, D + R], cache sent) or x ([N, D]; then ``w_down_LDR``, the
    local experts' [L, D, R] slices of W_down, recomputes C_i here). Weights are stacked per
    local expert: w_up [L, R, W] (factorization "none": [L, D, W - R]), w_p [L, D, W],
    w_o [L, W, D].
    """
    if factorized not in ops.FACTORIZATIONS:
        raise ValueError(f"unknown factorization {factorized!r}; choose one of {ops.FACTORIZATIONS}")
    return _GroupedExperts.apply(rows_NX, w_down_LDR, w_up, w_p, w_o, probs_N, groups, d_model,
                                 factorized, recompute_low_rank)
