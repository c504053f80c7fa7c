"""One expert's math for the lean expert path (``autograd``): the forward (SiLU(act) * lin * p) W_o
and its hand-written backward, run on 2-D rows of one expert (``mm`` = ``grouped.Dense``) or on
every expert at once in the groups' layout (``mm`` = the groups), in scratch memory reused expert
after expert. Shape names as in ``autograd``."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class Scratch:
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


def expert_forward(mm, scratch, x, c, w_up, w_p, w_o, p, factorized: str, out=None):
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


class Weights(NamedTuple):
    """The stacked expert weights (``w_down`` None when the cache is sent with the rows), or one
    expert's slices of them."""

    w_down: Optional[torch.Tensor]
    w_up: torch.Tensor
    w_p: torch.Tensor
    w_o: torch.Tensor


class Grads(NamedTuple):
    """Gradients of one piece: the rows ([dx | dc] or dx), the four weights, the probs."""

    rows: Optional[torch.Tensor]
    w_down: Optional[torch.Tensor]
    w_up: Optional[torch.Tensor]
    w_p: Optional[torch.Tensor]
    w_o: Optional[torch.Tensor]
    probs: Optional[torch.Tensor]


def expert_backward(mm, scratch, dy, x, c, act, lin, p, weights: Weights, *,
                     factorized: str, need: dict, d_rows=None) -> Grads:
    """Gradients of ``expert_forward`` (and of c = x W_down when ``weights.w_down`` is given);
    the rows' gradient [dx | dc] (or dx) is written into ``d_rows`` when given."""
    w_down, w_up, w_p, w_o = weights
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
    return Grads(rows=d_rows, w_down=d_w_down, w_up=d_w_up, w_p=d_w_p, w_o=d_w_o, probs=d_probs)
