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
R d_low, W d_wide, L local experts. The expert math (``_expert_forward``/``_expert_backward``)
names tensors without suffixes: they are one expert's 2-D rows, or every expert's rows in the
groups' layout ([N, .] or padded [L, M, .]).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from aoe_megatron import grouped, ops


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


class _Scratch:
    """Scratch buffers: reused expert after expert (backend "loop": ``rows`` = the busiest
    expert's rows), or fresh ones for a single pass over everything (``rows`` None).

    NOTE: on CPUs a fresh [rows, d_wide] tensor costs more to fault in than the elementwise op
    that fills it; reusing memory (and writing in place) keeps the expert math GEMM-bound.
    """

    def __init__(self, rows: Optional[int] = None):
        self.rows, self.flat = rows, {}

    def get(self, key: str, like: torch.Tensor) -> torch.Tensor:
        if self.rows is None:
            return torch.empty_like(like)
        width = like.shape[-1]
        buf = self.flat.get(key)
        if buf is None or buf.numel() < self.rows * width or buf.dtype != like.dtype:
            buf = self.flat[key] = like.new_empty(self.rows * width)
        return buf[: like.numel()].view(like.shape)


def _row_dot(a, b, dtype):
    """sum(a * b, -1) in ``dtype`` (a batched dot product where no cast is needed)."""
    if a.dtype == b.dtype == dtype:
        width = a.shape[-1]
        return torch.bmm(a.reshape(-1, 1, width), b.reshape(-1, width, 1)).view(a.shape[:-1])
    return (a.to(dtype) * b).sum(-1)


def _expert_forward(mm, scratch, x, c, w_up, w_p, w_o, p, factorized: str, out=None):
    """(out, act, lin) for one expert (2-D tensors, ``mm`` = grouped.Dense) or all experts
    (the groups' layout, ``mm`` = the groups): out = (SiLU(act) * lin * p) W_o."""
    lin = mm.mm(x, w_p)
    if factorized == "none":  # act = [C, x W_up]: the cache is the gate's first R elements
        act = torch.cat([c, mm.mm(x, w_up)], dim=-1)
    else:
        low = mm.mm(c, w_up)
        act, lin = (low, lin) if factorized == "gate" else (lin, low)
    # h = SiLU(act) * lin * p, computed in p's precision where it is wider (as megatron-core's
    # MLP scales by the probabilities), written in the activations' dtype
    h = torch.ops.aten.silu.out(act, out=scratch.get("h", act)).mul_(lin).mul_(p)
    return mm.mm(h, w_o, out=out), act, lin


def _expert_backward(mm, scratch, dy, x, c, act, lin, p, w_down, w_up, w_p, w_o,
                     factorized: str, need, d_rows=None):
    """Gradients of ``_expert_forward`` (and of c = x W_down when ``w_down`` is given):
    (d_rows, d_w_down, d_w_up, d_w_p, d_w_o, d_probs); d_rows = [dx | dc] or dx, written into
    ``d_rows`` when given."""
    silu = torch.ops.aten.silu.out(act, out=scratch.get("silu", act))
    g = torch.mul(silu, lin, out=scratch.get("g", act))  # the unweighted hidden state
    dh = mm.mm_t(dy, w_o, out=scratch.get("dh", act) if mm.accepts_out else None)
    d_probs = _row_dot(dh, g, p.dtype) if need["probs"] else None
    # (g p)^T dy = g^T (p dy): the scaling on the narrow side
    d_w_o = mm.wgrad(g, (dy * p).to(x.dtype), "w_o") if need["w_o"] else None
    dg = dh.mul_(p)  # gradient of g
    d_lin = silu.mul_(dg)
    d_act = torch.ops.aten.silu_backward.grad_input(dg.mul_(lin), act, grad_input=g)
    if factorized == "none":
        r = c.shape[-1]
        d_c, d_up = d_act[..., :r], d_act[..., r:]
        d_w_up = mm.wgrad(x, d_up, "w_up") if need["w_up"] else None
        dx = mm.mm_t(d_up, w_up) + mm.mm_t(d_lin, w_p)
        d_w_p = mm.wgrad(x, d_lin, "w_p") if need["w_p"] else None
    else:
        d_low, d_x_side = (d_act, d_lin) if factorized == "gate" else (d_lin, d_act)
        d_w_up = mm.wgrad(c, d_low, "w_up") if need["w_up"] else None
        d_c = mm.mm_t(d_low, w_up)
        d_w_p = mm.wgrad(x, d_x_side, "w_p") if need["w_p"] else None
        dx = mm.mm_t(d_x_side, w_p)
    d_w_down = None
    if w_down is not None:
        d_w_down = mm.wgrad(x, d_c, "w_down") if need["w_down"] else None
        dx = dx + mm.mm_t(d_c, w_down)
    if d_rows is not None:  # NOTE: d_c may view scratch memory: consumed before the next expert
        d_rows[..., : dx.shape[-1]].copy_(dx)
        if w_down is None:
            d_rows[..., dx.shape[-1] :].copy_(d_c)
    elif w_down is None:
        d_rows = torch.cat([dx, d_c.to(dx.dtype)], dim=-1)
    else:
        d_rows = dx
    return d_rows, d_w_down, d_w_up, d_w_p, d_w_o, d_probs


_INPUTS = ("rows", "w_down", "w_up", "w_p", "w_o", "probs")


class _GroupedExperts(torch.autograd.Function):
    """Saved: the rows [x | C] (or x, and C recomputed here), act and lin (C W_up left out with
    ``recompute_low_rank``), the probabilities. Per expert (backend "loop": one slice each) or
    in the groups' layout (padded, grouped_mm)."""

    @staticmethod
    def forward(ctx, rows_NX, w_down_LDR, w_up, w_p, w_o, probs_N, groups, d_model: int,
                factorized: str, recompute_low_rank: bool):
        drop = recompute_low_rank and factorized != "none"
        weights = (w_down_LDR, w_up, w_p, w_o)
        scratch = _Scratch(max(groups.counts, default=0) if groups.per_group else None)
        out_ND = rows_NX.new_empty(rows_NX.shape[0], d_model) if groups.per_group else None
        parts = []
        for sl, mm, (wd, wu, wp, wo) in _pieces(groups, weights):
            rows = _layout(groups, rows_NX)[sl]
            x = rows[..., :d_model]
            c = (rows[..., d_model:] if wd is None else mm.mm(x, wd)).to(x.dtype)
            p = _layout(groups, probs_N)[sl].unsqueeze(-1)
            out, act, lin = _expert_forward(mm, scratch, x, c, wu, wp, wo, p, factorized,
                                            out=None if out_ND is None else out_ND[sl])
            if drop:  # recomputed in backward from C
                act, lin = (None, lin) if factorized == "gate" else (act, None)
            parts.append((out, rows, c if wd is not None else None, act, lin, p))
        # NOTE: everything backward needs goes through save_for_backward (none on ctx), so
        # saved-tensor hooks (offloading, the benchmark's byte count) see all of it.
        ctx.save_for_backward(*weights, *[t for part in parts for t in part[1:]])
        ctx.groups, ctx.d_model, ctx.factorized, ctx.drop = groups, d_model, factorized, drop
        ctx.rows_shape = rows_NX.shape
        if groups.per_group:
            return out_ND
        return groups.unpack(parts[0][0])

    @staticmethod
    def backward(ctx, d_out_ND):
        saved = ctx.saved_tensors
        weights, rest = saved[:4], saved[4:]
        groups, fac = ctx.groups, ctx.factorized
        need = dict(zip(_INPUTS, ctx.needs_input_grad))
        # backend "loop": each expert's weight gradient is written straight into its slot
        wgrads = {name: torch.empty_like(w) for name, w in zip(_INPUTS[1:5], weights)
                  if w is not None and need[name]} if groups.per_group else {}
        scratch = _Scratch(max(groups.counts, default=0) if groups.per_group else None)
        per = groups.per_group
        d_rows = d_out_ND.new_empty(ctx.rows_shape) if per and need["rows"] else None
        d_probs = d_out_ND.new_zeros(ctx.rows_shape[0], dtype=rest[4].dtype) if per and rest else None
        dy_all = _layout(groups, d_out_ND)
        for i, (sl, mm, (wd, wu, wp, wo)) in enumerate(_pieces(groups, weights, wgrads)):
            rows, c, act, lin, p = rest[5 * i : 5 * i + 5]
            x = rows[..., : ctx.d_model]
            c = rows[..., ctx.d_model :] if c is None else c
            if ctx.drop:  # the low-rank projection C W_up, recomputed
                low = mm.mm(c, wu)
                act, lin = (low, lin) if fac == "gate" else (act, low)
            piece = _expert_backward(mm, scratch, dy_all[sl], x, c, act, lin, p, wd, wu, wp, wo,
                                     fac, need, d_rows=None if d_rows is None else d_rows[sl])
            if per:
                if piece[5] is not None:
                    d_probs[sl] = piece[5]
            else:
                d_rows = groups.unpack(piece[0]) if need["rows"] else None
                d_probs = groups.unpack(piece[5]) if need["probs"] else None
                wgrads.update((name, g) for name, g in zip(_INPUTS[1:5], piece[1:5]) if g is not None)
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
        return [(sl, _ExpertSlot(l, wgrads or {}), tuple(None if w is None else w[l] for w in weights))
                for l, sl in _busy(groups)]
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
