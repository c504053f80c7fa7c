"""The lean autograd functions and the grouped expert backends against the plain autograd loop.

Every backend (loop, padded, grouped_mm), factorization and cache mode equals the per-expert
autograd loop (the previous implementation) to 1e-6 in fp32, forward and backward; what each
function keeps for backward is counted exactly.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from aoe_megatron.moe import grouped
from aoe_megatron.moe import autograd
from aoe_megatron.moe import ops
from tests.helpers import build_aoe_layer, make_transformer_config, reference_aoe

D, R, W, L = 16, 8, 24, 4
COUNTS = [5, 0, 9, 2]  # uneven, one expert without tokens
BACKENDS = ["loop", "padded", "grouped_mm"]


def _assert_close_to_scale(got, want, tol, msg):
    """|got - want| <= tol * max|want|: equal up to the rounding of a reordered sum."""
    err = (got - want).abs().max().item()
    scale = max(want.abs().max().item(), 1.0)
    assert err <= tol * scale, f"{msg}: max error {err:.3g} > {tol:g} x {scale:.3g}"


def _weights(factorized, dtype=torch.float32):
    gen = torch.Generator().manual_seed(5)
    up_shape = (D, W - R) if factorized == "none" else (R, W)
    make = lambda *s: (torch.randn(*s, generator=gen, dtype=torch.float64) * 0.3).to(dtype)  # noqa: E731
    return {"w_up": make(L, *up_shape), "w_p": make(L, D, W), "w_o": make(L, W, D),
            "w_down": make(L, D, R)}


def _reference(rows, probs, w, factorized, recompute_cache):
    """The plain autograd loop: ops.aoe_expert per expert on stacked-weight slices."""
    outs = []
    for local, part in enumerate(torch.split(rows, COUNTS)):
        x = part[:, :D]
        c = x @ w["w_down"][local] if recompute_cache else part[:, D:]
        outs.append(ops.aoe_expert(x, c, w_up_RW=w["w_up"][local], w_p_DW=w["w_p"][local],
                                   w_o_WD=w["w_o"][local], factorized=factorized))
    return torch.cat(outs) * probs.unsqueeze(-1)


def _run(fn, rows, probs, w, dy):
    leaves = {"rows": rows, "probs": probs, **w}
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in leaves.items()}
    out = fn(leaves)
    out.backward(dy)
    return out.detach(), {k: v.grad for k, v in leaves.items()}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("factorized", ["gate", "up", "none"])
@pytest.mark.parametrize("recompute_cache", [False, True])
@pytest.mark.parametrize("recompute_low_rank", [False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
def test_grouped_experts_equal_the_autograd_loop(backend, factorized, recompute_cache,
                                                 recompute_low_rank, dtype, tol):
    if backend == "grouped_mm" and dtype == torch.float64:
        pytest.skip("torch._grouped_mm takes fp32/bf16/fp16 only")
    gen = torch.Generator().manual_seed(1)
    n = sum(COUNTS)
    rows = torch.randn(n, D if recompute_cache else D + R, generator=gen, dtype=dtype)
    probs = torch.rand(n, generator=gen, dtype=dtype)
    dy = torch.randn(n, D, generator=gen, dtype=dtype)
    w = _weights(factorized, dtype)
    groups = grouped.make_groups(COUNTS, backend=backend, device=rows.device, dtype=rows.dtype,
                                 widths=(D, R, W, W - R))
    assert groups.name == backend

    def lean(v):
        return autograd.grouped_experts(
            v["rows"], probs_N=v["probs"], groups=groups, d_model=D, w_up=v["w_up"],
            w_p=v["w_p"], w_o=v["w_o"], w_down_LDR=v["w_down"] if recompute_cache else None,
            factorized=factorized, recompute_low_rank=recompute_low_rank)

    out, grads = _run(lean, rows, probs, w, dy)
    ref_out, ref_grads = _run(lambda v: _reference(v["rows"], v["probs"], v, factorized,
                                                   recompute_cache), rows, probs, w, dy)
    _assert_close_to_scale(out, ref_out, tol, "forward")
    for name, ref in ref_grads.items():
        if ref is None:  # W_down is used in cache mode "recompute" only
            assert grads[name] is None and not recompute_cache, name
            continue
        _assert_close_to_scale(grads[name], ref, tol, f"gradient of {name}")
    assert grads["w_up"][1].abs().max() == 0  # the expert without tokens gets a zero gradient


def _saved_activation_bytes(fn, params):
    """Bytes of the tensors autograd keeps for backward, each storage once, parameters excluded."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    out.sum().backward()
    return sum(seen.values())


@pytest.mark.parametrize("recompute_low_rank", [False, True])
def test_expert_kernel_keeps_rows_projections_and_probs_only(recompute_low_rank):
    n = sum(COUNTS)
    rows = torch.randn(n, D + R, requires_grad=True)
    probs = torch.rand(n, requires_grad=True)
    w = {k: v.requires_grad_(True) for k, v in _weights("gate").items()}
    groups = grouped.make_groups(COUNTS, backend="loop", device=rows.device, dtype=rows.dtype,
                                 widths=(D, R, W))
    saved = _saved_activation_bytes(lambda: autograd.grouped_experts(
        rows, probs_N=probs, groups=groups, d_model=D, w_up=w["w_up"], w_p=w["w_p"],
        w_o=w["w_o"], recompute_low_rank=recompute_low_rank), list(w.values()))
    wide = 1 if recompute_low_rank else 2  # x W_p, and C W_up unless recomputed
    assert saved == 4 * (n * (D + R) + wide * n * W + n)
    naive = _saved_activation_bytes(lambda: _reference(rows, probs, w, "gate", False), list(w.values()))
    assert saved < naive


@pytest.mark.parametrize("order", ops.NORM_ORDERS)
@pytest.mark.parametrize("use_cache", [True, False])
def test_cache_and_norms_equal_autograd_and_keep_x_only(order, use_cache):
    gen = torch.Generator().manual_seed(2)
    t, e = 11, 5
    x = torch.randn(t, D, generator=gen, dtype=torch.float64)
    w = torch.randn(D, e * R, generator=gen, dtype=torch.float64)
    d_norms = torch.randn(t, e, generator=gen, dtype=torch.float64)
    d_cache = torch.randn(t, e, R, generator=gen, dtype=torch.float64)
    results = []
    for lean in (True, False):
        xl, wl = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        if lean:
            cache, norms = autograd.cache_and_norms(xl, w_down_DER=wl, num_experts=e, order=order)
        else:
            cache = ops.low_rank_cache(xl, w_down_DER=wl, num_experts=e)
            norms = ops.expert_norms(cache, order=order)
        loss = (norms * d_norms).sum() + ((cache * d_cache).sum() if use_cache else 0)
        loss.backward()
        results.append((cache.detach(), norms.detach(), xl.grad, wl.grad))
    for got, want, what in zip(results[0], results[1], ("cache", "norms", "dx", "dW_down")):
        assert_close(got, want, rtol=1e-12, atol=1e-12, msg=what)
    xl, wl = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    saved = _saved_activation_bytes(
        lambda: autograd.cache_and_norms(xl, w_down_DER=wl, num_experts=e, order=order)[1], [wl])
    assert saved == x.nbytes  # x only: the [T, E * R] cache is recomputed in backward


@pytest.mark.parametrize("backend", BACKENDS + ["autograd"])
@pytest.mark.parametrize("cache_mode", ["send", "recompute"])
def test_layer_with_each_backend_matches_algorithm_2(seeded, backend, cache_mode):
    tc = make_transformer_config(d_model=D, d_ffn=32, num_experts=L, top_k=2, alpha_aux=0.01)
    layer = build_aoe_layer(tc, d_low=R, d_wide=W, expert_backend=backend, cache_mode=cache_mode)
    x = torch.randn(6, 2, D).requires_grad_(True)
    g = torch.randn(6, 2, D)
    out, _ = layer(x)
    (out * g).sum().backward()
    x64 = x.detach().double().requires_grad_(True)
    ref_w = {n: p.detach().double().requires_grad_(True) for n, p in (
        ("w_down", layer.router.weight), ("w_up", layer.experts.w_up),
        ("w_p", layer.experts.w_p), ("w_o", layer.experts.w_o))}
    ref, aux = reference_aoe(x64.reshape(-1, D), ref_w["w_down"], ref_w["w_up"], ref_w["w_p"],
                             ref_w["w_o"], top_k=2, alpha_aux=0.01)
    ((ref.reshape(x.shape) * g.double()).sum() + aux).backward()
    tol = dict(rtol=2e-5, atol=2e-5)
    assert_close(out.double(), ref.reshape(x.shape), **tol)
    assert_close(x.grad.double(), x64.grad, **tol)
    for name, p in (("w_down", layer.router.weight), ("w_up", layer.experts.w_up),
                    ("w_p", layer.experts.w_p), ("w_o", layer.experts.w_o)):
        assert_close(p.grad.double(), ref_w[name].grad, msg=name, **tol)


def test_bf16_grouped_mm_tracks_the_loop():
    gen = torch.Generator().manual_seed(3)
    n = sum(COUNTS)
    rows = torch.randn(n, D + R, generator=gen).bfloat16()
    probs = torch.rand(n, generator=gen)
    w = {k: v.bfloat16() for k, v in _weights("gate").items()}
    outs = []
    for backend in ("loop", "grouped_mm"):
        groups = grouped.make_groups(COUNTS, backend=backend, device=rows.device,
                                     dtype=torch.bfloat16, widths=(D, R, W))
        outs.append(autograd.grouped_experts(rows, probs_N=probs, groups=groups, d_model=D,
                                            w_up=w["w_up"], w_p=w["w_p"], w_o=w["w_o"]))
    assert outs[0].dtype == torch.bfloat16
    assert_close(outs[1].float(), outs[0].float(), rtol=2e-2, atol=2e-2)


def test_backend_choice_and_clear_errors():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    pick = lambda dev, dt, widths: grouped.auto_backend(device=dev, dtype=dt, widths=widths)  # noqa: E731
    assert pick(cuda, torch.bfloat16, (768, 256, 3840)) == "grouped_mm"
    assert pick(cuda, torch.float32, (768, 256, 3840)) == "loop"  # CUDA grouped GEMMs: bf16
    assert pick(cuda, torch.bfloat16, (768, 250, 3840)) == "loop"  # 500 bytes: unaligned
    assert pick(cpu, torch.float32, (768, 256, 3840)) == "loop"
    assert pick(cpu, torch.float32, (768, 64, 528)) == "loop"
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        grouped.make_groups([1, 2], backend="grouped_mm", device=cpu, dtype=torch.float32,
                            widths=(16, 6, 20))
    with pytest.raises(ValueError, match="grouped_mm"):
        grouped.make_groups([1, 2], backend="grouped_mm", device=cpu, dtype=torch.float64,
                            widths=(16, 8, 24))
    with pytest.raises(ValueError, match="unknown grouped GEMM backend"):
        grouped.make_groups([1], backend="triton", device=cpu, dtype=torch.float32, widths=(16,))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_grouped_mm_bf16_matches_loop():
    dev = torch.device("cuda")
    counts = [300, 0, 129, 77]
    n = sum(counts)
    rows = torch.randn(n, 64 + 16, device=dev, dtype=torch.bfloat16)
    probs = torch.rand(n, device=dev)
    w = {"w_up": torch.randn(4, 16, 96), "w_p": torch.randn(4, 64, 96), "w_o": torch.randn(4, 96, 64)}
    w = {k: (v * 0.1).to(dev, torch.bfloat16).requires_grad_(True) for k, v in w.items()}
    outs, grads = [], []
    for backend in ("loop", "grouped_mm"):
        groups = grouped.make_groups(counts, backend=backend, device=dev, dtype=torch.bfloat16,
                                     widths=(64, 16, 96))
        out = autograd.grouped_experts(rows, probs_N=probs, groups=groups, d_model=64, **w)
        out.float().square().sum().backward()
        outs.append(out.detach().float())
        grads.append({k: v.grad.float().clone() for k, v in w.items()})
        for v in w.values():
            v.grad = None
    assert_close(outs[1], outs[0], rtol=2e-2, atol=2e-2)
    for k in w:
        assert_close(grads[1][k], grads[0][k], rtol=5e-2, atol=5e-2, msg=k)


def _backward_without_tokens(device: str, counts):
    """A rank whose local experts got ``counts`` rows (all zero: no tokens at all): the forward
    gives [0, D] and the backward zero weight gradients (every rank reduces them under EP)."""
    dev = torch.device(device)
    n, dt = sum(counts), torch.bfloat16
    gen = torch.Generator().manual_seed(4)
    rows = torch.randn(n, 64 + 16, generator=gen).to(dev, dt).requires_grad_(True)
    probs = torch.rand(n, generator=gen).to(dev).requires_grad_(True)
    shapes = {"w_up": (16, 96), "w_p": (64, 96), "w_o": (96, 64)}
    w = {k: (torch.randn(len(counts), *s, generator=gen) * 0.1).to(dev, dt).requires_grad_(True)
         for k, s in shapes.items()}
    groups = grouped.make_groups(counts, backend="grouped_mm", device=dev, dtype=dt,
                                 widths=(64, 16, 96))
    out = autograd.grouped_experts(rows, probs_N=probs, groups=groups, d_model=64, **w)
    out.float().square().sum().backward()
    assert out.shape == (n, 64)
    for name, v in w.items():
        for local, count in enumerate(counts):
            if count == 0:
                assert v.grad[local].abs().max().item() == 0, f"{name} of expert {local}"


def test_grouped_mm_backward_for_experts_without_tokens(monkeypatch):
    """On CPU with ``_grouped_mm`` behaving as reported on GPUs: a contraction of length 0 is
    refused (CUDA's stride check) and an empty group's weight gradient is left as garbage
    (pytorch/pytorch#172439); the CPU kernel itself copes with both."""
    real = torch._grouped_mm

    def as_on_gpus(a, b, offs=None, **kw):
        if a.dim() == 2 and b.dim() == 2 and a.shape[1] == 0:
            raise RuntimeError("strides should be multiple of 16 bytes")
        out = real(a, b, offs=offs, **kw)
        if a.dim() == 2 and b.dim() == 2:  # the weight-gradient form: one [A, B] per group
            sizes = torch.diff(offs.long(), prepend=offs.new_zeros(1).long())
            out[sizes == 0] = float("nan")
        return out

    monkeypatch.setattr(torch, "_grouped_mm", as_on_gpus)
    _backward_without_tokens("cpu", [0, 0, 0, 0])
    _backward_without_tokens("cpu", [0, 40, 0, 17])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_grouped_mm_backward_for_experts_without_tokens():
    """CUDA's ``_grouped_mm`` rejects a weight-gradient GEMM with no rows at all."""
    _backward_without_tokens("cuda", [0, 0, 0, 0])
    _backward_without_tokens("cuda", [0, 40, 0, 17])
