"""`make bench`: the FLOP formulas and memory probes by hand, the tool and the GPU script end to end.

Timings are never asserted: only that they were taken.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close
from torch.utils.flop_counter import FlopCounterMode

from aoe_megatron.bench import flops as fl
from aoe_megatron.bench.measure import SavedTensorBytes

REPO = Path(__file__).resolve().parent.parent
# NOTE: one thread: the values checked do not depend on it and a shared CPU stalls less.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
T, D, E, K, R, W, F = 2, 4, 3, 2, 2, 5, 6


def _counted(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def test_aoe_flops_against_a_hand_count_and_a_counted_loop():
    # cache 2*2*4*6 = 96; per (token, expert): C_i W_up 2*2*5 + x W_p 2*4*5 + h W_o 2*5*4 = 100
    got = fl.aoe_block_forward_flops(tokens=T, d_model=D, num_experts=E, top_k=K, d_low=R, d_wide=W)
    assert got == 96 + T * K * 100
    x, w_down = torch.randn(T, D), torch.randn(D, E * R)
    w_up, w_p, w_o = torch.randn(E, R, W), torch.randn(E, D, W), torch.randn(E, W, D)

    def plain_aoe():  # Algorithm 2, one token and expert at a time (experts 0 and 2 selected)
        cache = (x @ w_down).view(T, E, R)
        for t in range(T):
            for i in (0, 2):
                h = torch.nn.functional.silu(cache[t, i] @ w_up[i]) * (x[t] @ w_p[i])
                h @ w_o[i]

    assert _counted(plain_aoe) == got


def test_moe_flops_against_a_counted_loop():
    got = fl.moe_block_forward_flops(tokens=T, d_model=D, num_experts=E, top_k=K, d_ffn=F)
    assert got == 2 * T * D * E + T * K * (2 * D * F * 3)
    x, w_r = torch.randn(T, D), torch.randn(D, E)
    w_g, w_u, w_d = torch.randn(E, D, F), torch.randn(E, D, F), torch.randn(E, F, D)

    def plain_moe():
        x @ w_r
        for t in range(T):
            for i in (1, 2):
                (torch.nn.functional.silu(x[t] @ w_g[i]) * (x[t] @ w_u[i])) @ w_d[i]

    assert _counted(plain_moe) == got


def test_flop_ratios_extras_and_model_step():
    dims = dict(tokens=T, d_model=D, num_experts=E, top_k=K)
    fwd = fl.aoe_block_forward_flops(**dims, d_low=R, d_wide=W)
    assert fl.training_flops(fwd) == 3 * fwd
    assert fl.recompute_extra_flops("lean_cache", **dims, d_low=R, d_wide=W) == 96
    assert fl.recompute_extra_flops("low_rank", **dims, d_low=R, d_wide=W) == 2 * T * K * R * W
    assert fl.recompute_extra_flops("moe_layer", **dims, d_low=R, d_wide=W) == fwd
    assert fl.recompute_extra_flops("moe_act", **dims) == 0
    with pytest.raises(ValueError, match="unknown recompute option"):
        fl.recompute_extra_flops("everything", **dims)
    # 6 N T + 12 L D S T
    assert fl.model_step_flops(tokens=10, matmul_params=100, num_layers=2, d_model=4,
                               seq_length=5) == 6000 + 4800

    from aoe_megatron.bench.arms import SHAPES, shape_flops

    f732 = shape_flops(SHAPES["732m"], ["moe", "aoe", "aoe-full-cache"])
    assert f732["ratio"] == pytest.approx(1.083, abs=0.005)
    assert shape_flops(SHAPES["fine64"], ["moe"])["ratio"] == pytest.approx(1.38, abs=0.01)
    # lean_cache (the default) runs the cache GEMM again in backward: 2 T D E R more hardware FLOPs
    cache = 2 * 4096 * 768 * 8 * 256
    assert f732["hardware"]["aoe"] - f732["model"]["aoe"] == cache
    assert f732["hardware"]["aoe-full-cache"] == f732["model"]["aoe-full-cache"]


def test_saved_bytes_of_a_matmul_shared_storage_once_parameters_excluded():
    a = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(4, 5, requires_grad=True)
    with SavedTensorBytes() as counter:
        out = a @ b
    out.sum().backward()
    assert (counter.count, counter.nbytes) == (2, (12 + 20) * 4)

    x = torch.randn(6, 4, requires_grad=True)
    with SavedTensorBytes() as counter:  # two views of x and b twice: each storage once
        out = (x[:3] @ b).sum() + (x[3:] @ b).sum()
    out.backward()
    assert (counter.count, counter.nbytes) == (4, (24 + 20) * 4)

    lin = torch.nn.Linear(4, 5, bias=False)
    with SavedTensorBytes(exclude=lin.parameters()) as counter:
        out = lin(x)
    out.sum().backward()
    assert counter.count >= 2
    assert counter.nbytes == 24 * 4  # x only: the weight is a parameter


def test_cpu_peak_memory_sees_a_freed_100_mib_tensor():
    # NOTE: in a subprocess: the probe changes malloc's mmap threshold for the whole process.
    script = (
        "import torch\n"
        "from aoe_megatron.bench.measure import enable_cpu_peak_tracking, peak_memory\n"
        "assert enable_cpu_peak_tracking()\n"
        "def alloc():\n"
        "    t = torch.ones(25 * 2**20)\n"
        "    del t\n"
        "print(peak_memory(alloc, 'cpu'), peak_memory(lambda: None, 'cpu'))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=ENV,
                         cwd=REPO, timeout=60, check=True)
    big, nothing = (int(v) for v in out.stdout.split())
    assert 100 * 2**20 <= big <= 110 * 2**20, big
    assert nothing < 4 * 2**20, nothing


def _run(cmd, **kw):
    out = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=REPO, timeout=170, **kw)
    assert out.returncode == 0, f"{cmd} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def test_bad_flags_are_refused_clearly():
    for flags, message in ((["--only", "layer,speed"], "--only takes"),
                           (["--reps", "0"], "--reps must be at least 1"),
                           (["--quick", "--shapes", "732m"], "with --quick choose from tiny8")):
        out = subprocess.run([sys.executable, "tools/bench.py", *flags], capture_output=True,
                             text=True, env=ENV, cwd=REPO, timeout=120)
        assert out.returncode == 2 and message in out.stderr, (flags, out.stderr[-2000:])


def test_quick_run_end_to_end(tmp_path):
    out = _run([sys.executable, "tools/bench.py", "--quick", "--out", str(tmp_path)])
    assert "[layer tiny8] aoe-naive rep 2/2" in out.stdout  # progress lines
    res = json.loads((tmp_path / "results.json").read_text())
    assert set(res) == {"layer", "model", "ep", "meta"}
    meta = res["meta"]
    assert meta["command"] == f"tools/bench.py --quick --out {tmp_path}"
    assert {"cpu", "cores", "torch", "megatron_core"} <= set(meta["machine"]) and meta["wall_s"] > 0

    assert set(res["layer"]) == {"tiny8", "tiny64"}
    # d_wide64 where Eq. 5's d_wide is no multiple of 64 (tiny8: 164, tiny64: 42)
    arms = {"moe", "aoe", "aoe-full-cache", "aoe-padded", "aoe-d_wide64", "aoe-naive"}
    for name, shape in res["layer"].items():
        # grouped_mm where torch._grouped_mm applies: tiny8's widths (64, 16, 164) are 16-byte
        # multiples in fp32, tiny64's d_wide 42 is not
        assert set(shape["arms"]) == arms | ({"aoe-grouped_mm"} if name == "tiny8" else set()), name
        for arm in shape["arms"].values():
            assert len(arm["time_s"]["reps"]) == 2 and len(arm["cpu_s"]["reps"]) == 2
            assert arm["time_s"]["min"] <= arm["time_s"]["median"] <= arm["time_s"]["max"]
            assert arm["saved_bytes"] > 0 and "peak_bytes" in arm
        s = shape["shape"]
        assert shape["flops"]["aoe_forward"] == fl.aoe_block_forward_flops(
            tokens=s["tokens"], d_model=s["d_model"], num_experts=s["num_experts"],
            top_k=s["top_k"], d_low=s["d_low"], d_wide=s["d_wide"])
        rows = {(r["policy"], r["arch"]): r["saved_bytes"] for r in shape["recompute"]}
        assert set(rows) == {("moe", "moe"), ("moe", "aoe"), ("low_rank", "aoe")}
        # megatron's layer recompute keeps only the layer input (fp32)
        assert rows[("moe", "moe")] == s["tokens"] * s["d_model"] * 4, name
        assert set(shape["ratios"]["targets"]) == {"time", "time_full_cache", "time_d_wide64",
                                                   "saved_bytes_none", "saved_bytes_recompute_moe"}
        # the d_wide64 arm's FLOPs use its own, wider d_wide
        w64 = -(-s["d_wide"] // 64) * 64
        assert shape["flops"]["model"]["aoe-d_wide64"] == fl.training_flops(fl.aoe_block_forward_flops(
            tokens=s["tokens"], d_model=s["d_model"], num_experts=s["num_experts"],
            top_k=s["top_k"], d_low=s["d_low"], d_wide=w64))

    tiny = res["model"]["models"]["tiny"]
    assert res["model"]["peak_flops"] > 0
    for arch in ("moe", "aoe"):
        assert tiny["archs"][arch]["tokens_per_s"] > 0 and tiny["archs"][arch]["mfu"] > 0

    ep = res["ep"]
    s = ep["shape"]
    for arm, width in (("moe", s["d_model"]), ("aoe-send", s["d_model"] + s["d_low"]),
                       ("aoe-recompute", s["d_model"])):
        a = ep["arms"][arm]
        assert a["measured_dispatch_row_width"] == width, arm
        assert a["measured_dispatch_bytes"] == a["expected_dispatch_bytes"] > 0, arm
        assert a["all_to_all_bytes"]["backward"] > 0, arm

    md = (tmp_path / "README.md").read_text()
    assert "| shape | arm | wall ms | CPU ms | saved MiB | peak MiB |" in md
    assert "| tiny64 | aoe-naive |" in md and "## Expert parallel (EP=2)" in md
    assert f"`tools/bench.py --quick --out {tmp_path}`" in md


def test_gpu_script_runs_in_cpu_mode(tmp_path):
    _run(["bash", "tools/bench_gpu.sh", "--cpu", "--shapes", "tiny8", "--only", "layer",
          "--out", str(tmp_path)])
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["meta"]["device"] == "cpu" and res["meta"]["quick"] is True
    assert list(res["layer"]) == ["tiny8"] and "ep" not in res
    assert "| tiny8 | aoe |" in (tmp_path / "README.md").read_text()
