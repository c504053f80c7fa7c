"""The ``moe-grouped`` benchmark arm (``aoe_megatron/bench/mcore_grouped.py``): the ``gmm`` adapter
against a float64 per-group loop, and megatron-core's legacy GroupedMLP through it against
SequentialMLP with the same weights, forward and backward, uneven groups and an empty expert.

Tolerances. fp32: both sides run the same products with fp32 accumulation, in another order, so
they agree to a few fp32 roundings (relative 1e-5 of the largest value). bf16: operands are bf16
and each GEMM accumulates in fp32 and rounds its output once to bf16 (8 significant bits); the two
implementations may round the SwiGLU * prob product at a different step, so an element may differ
by about two bf16 rounding steps, 2^-7 relative (the CPU kernels agree exactly today).
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from aoe_megatron.bench import mcore_grouped as mg

COUNTS = [5, 0, 17, 3]  # uneven, expert 1 empty
D, F = 32, 48  # 16-byte multiples in fp32 and bf16: D, F, 2F
BF16_RTOL = 2.0 ** -7


def _close(got, want, *, dtype, msg):
    """``got`` against ``want`` with the dtype's tolerance (module docstring), relative to the
    largest |want| (these tensors hold values of one scale)."""
    rtol = 1e-5 if dtype == torch.float32 else BF16_RTOL
    scale = want.double().abs().max().item()
    assert scale > 0, msg
    assert_close(got.double(), want.double(), rtol=rtol, atol=rtol * scale, msg=msg)


def _loop(a, b, counts, trans_b):
    """The reference: one float64 matmul per group."""
    outs, start = [], 0
    for l, c in enumerate(counts):
        w = b[l].double()
        outs.append(a[start:start + c].double() @ (w.t() if trans_b else w))
        start += c
    return torch.cat(outs)


def _poison_empty_groups(monkeypatch):
    """``torch._grouped_mm`` as reported on some GPUs: an empty group's weight gradient comes back
    as garbage (pytorch/pytorch#172439), here NaN; the CPU kernel itself gives zeros."""
    real = torch._grouped_mm

    def poisoned(a, b, offs=None, **kw):
        out = real(a, b, offs=offs, **kw)
        if a.dim() == 2 and b.dim() == 2:
            ends = offs.long()
            sizes = ends - torch.cat([ends.new_zeros(1), ends[:-1]])
            out[sizes == 0] = float("nan")
        return out

    monkeypatch.setattr(torch, "_grouped_mm", poisoned)


def _check_gmm(device, dtype, trans_b, counts):
    gen = torch.Generator().manual_seed(0)
    a_in, b_out = 32, 48  # A != B: trans_b ignored would not even run
    a = torch.randn(sum(counts), a_in, generator=gen).to(device, dtype).requires_grad_()
    b_shape = (len(counts), b_out, a_in) if trans_b else (len(counts), a_in, b_out)
    b = torch.randn(*b_shape, generator=gen).to(device, dtype).requires_grad_()
    dy = torch.randn(sum(counts), b_out, generator=gen).to(device, dtype)
    out = mg.gmm(a, b, torch.tensor(counts), trans_b=trans_b)
    out.backward(dy)
    a64, b64 = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    want = _loop(a64, b64, counts, trans_b)
    want.backward(dy.double())
    assert out.shape == (sum(counts), b_out) and out.dtype == dtype
    if sum(counts):
        _close(out, want, dtype=dtype, msg="forward")
        _close(a.grad, a64.grad, dtype=dtype, msg="input gradient")
    for l, c in enumerate(counts):
        if c == 0:
            assert torch.count_nonzero(b.grad[l]) == 0, f"weight gradient of empty expert {l}"
        else:
            _close(b.grad[l], b64.grad[l], dtype=dtype, msg=f"weight gradient of expert {l}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("trans_b", [False, True])
def test_gmm_matches_a_per_group_loop_with_an_empty_expert(monkeypatch, dtype, trans_b):
    _poison_empty_groups(monkeypatch)
    _check_gmm("cpu", dtype, trans_b, COUNTS)
    _check_gmm("cpu", dtype, trans_b, [0, 0, 0])  # a rank whose experts got no rows


def test_gmm_refuses_what_grouped_mm_cannot_run():
    a = torch.randn(4, 12)  # 48 bytes a row: fine; the output width 20 (80 bytes) too
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        mg.gmm(a, torch.randn(2, 12, 6), torch.tensor([1, 3]))  # 24-byte rows
    with pytest.raises(ValueError, match="2 groups of 3 rows"):
        mg.gmm(a, torch.randn(2, 12, 20), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="takes 20"):
        mg.gmm(a, torch.randn(2, 12, 20), torch.tensor([1, 3]), trans_b=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("trans_b", [False, True])
def test_cuda_gmm_bf16_matches_a_per_group_loop(trans_b):
    _check_gmm("cuda", torch.bfloat16, trans_b, [300, 0, 129, 77])
    _check_gmm("cuda", torch.bfloat16, trans_b, [0, 0, 0])


def _grouped_and_sequential(dtype):
    from aoe_megatron.bench.arms import LayerShape, build_moe, layer_transformer_config

    shape = LayerShape(d_model=D, num_experts=len(COUNTS), top_k=2, d_ffn=F, d_low=8, tokens=16)
    tc = layer_transformer_config(shape, dtype=dtype, device="cpu", use_te=False)
    torch.manual_seed(0)
    moe = build_moe(tc, device="cpu", use_te=False)
    grouped = mg.build_grouped_moe(tc, device="cpu", use_te=False)
    mg.copy_from_sequential(grouped, moe)
    assert type(grouped.experts) is mg.legacy_grouped_mlp()
    return moe, grouped


needs_legacy = pytest.mark.skipif(
    mg.legacy_grouped_mlp() is None,
    reason="this megatron-core has no legacy GroupedMLP (gone after 0.16); the moe-grouped arm "
           "needs TransformerEngine's TEGroupedMLP there, which needs CUDA")


@needs_legacy
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mlp_through_the_adapter_equals_sequential_mlp(megatron_world, monkeypatch, dtype):
    _poison_empty_groups(monkeypatch)
    with mg.installed():
        moe, grouped = _grouped_and_sequential(dtype)
        gen = torch.Generator().manual_seed(1)
        n = sum(COUNTS)
        x = torch.randn(n, D, generator=gen).to(dtype)
        probs, dy = torch.rand(n, generator=gen), torch.randn(n, D, generator=gen).to(dtype)
        got = {}
        for name, layer in (("sequential", moe), ("grouped", grouped)):
            x_in, p_in = x.clone().requires_grad_(), probs.clone().requires_grad_()
            out, _ = layer.experts(x_in, torch.tensor(COUNTS), p_in)
            out.backward(dy)
            got[name] = {"output": out, "input gradient": x_in.grad, "prob gradient": p_in.grad}
    for key, want in got["sequential"].items():
        _close(got["grouped"][key], want, dtype=dtype, msg=key)
    from aoe_megatron.models.spec import expert_weight_pairs

    e = grouped.experts
    w1_grad = e.weight1.grad.view(len(COUNTS), D, 2 * F)
    w2_grad = e.weight2.grad.view(len(COUNTS), F, D)
    for l, (fc1, fc2) in enumerate(expert_weight_pairs(moe.experts)):
        if COUNTS[l] == 0:
            assert torch.count_nonzero(w1_grad[l]) == torch.count_nonzero(w2_grad[l]) == 0
            continue
        _close(w1_grad[l], fc1.grad.t(), dtype=dtype, msg=f"fc1 gradient of expert {l}")
        _close(w2_grad[l], fc2.grad.t(), dtype=dtype, msg=f"fc2 gradient of expert {l}")


@needs_legacy
def test_the_moe_grouped_arm_is_the_moe_arm_in_another_kernel(megatron_world):
    """The benchmark's two megatron-core arms compute one function: same router, same experts."""
    with mg.installed():
        moe, grouped = _grouped_and_sequential(torch.float32)
        x = torch.randn(16, 1, D, generator=torch.Generator().manual_seed(2))
        _close(grouped(x)[0], moe(x)[0], dtype=torch.float32, msg="layer output")
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    assert not gg.grouped_gemm_is_available()  # restored on exit


def test_unavailable_reason_says_why():
    cpu = dict(d_model=D, d_ffn=F, device="cpu", dtype=torch.float32)
    if mg.legacy_grouped_mlp() is None:
        assert "no legacy GroupedMLP" in mg.unavailable_reason(**cpu, use_te=False)
        assert mg.unavailable_reason(**cpu, use_te=True) is None  # TEGroupedMLP stands in
    else:
        assert mg.unavailable_reason(**cpu, use_te=False) is None
        odd = mg.unavailable_reason(**{**cpu, "d_ffn": 42}, use_te=False)
        assert "cannot run" in odd and "(32, 42, 84)" in odd
