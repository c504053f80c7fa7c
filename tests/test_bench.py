"""`make bench`: the FLOP formulas and memory probes by hand, the tool end to end.

Timings are never asserted: only that they were taken.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
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
        out = subprocess.run([sys.executable, "-m", "aoe_megatron.cli.bench", *flags],
                             capture_output=True, text=True, env=ENV, cwd=REPO, timeout=120)
        assert out.returncode == 2 and message in out.stderr, (flags, out.stderr[-2000:])


@pytest.mark.slow
def test_quick_run_end_to_end(tmp_path):
    out = _run([sys.executable, "-m", "aoe_megatron.cli.bench", "--quick", "--model-archs",
                "moe,aoe,aoe-loop", "--out", str(tmp_path)])
    assert "[layer tiny8] aoe-naive rep 2/2" in out.stdout  # progress lines
    res = json.loads((tmp_path / "results.json").read_text())
    assert set(res) == {"layer", "model", "ep", "meta"}
    meta = res["meta"]
    assert meta["command"] == f"aoe-bench --quick --model-archs moe,aoe,aoe-loop --out {tmp_path}"
    assert {"cpu", "cores", "torch", "megatron_core"} <= set(meta["machine"]) and meta["wall_s"] > 0

    assert set(res["layer"]) == {"tiny8", "tiny64"}
    # d_wide64 (up and nearest) where Eq. 5's d_wide is no multiple of 64 (tiny8: 164, tiny64: 42)
    arms = {"moe", "moe-grouped", "aoe", "aoe-full-cache", "aoe-padded", "aoe-d_wide64",
            "aoe-d_wide64-nearest", "aoe-naive"}
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
        assert set(shape["ratios"]["targets"]) == {
            "time", "time_full_cache", "time_d_wide64", "time_d_wide64_nearest", "saved_bytes_none",
            "saved_bytes_recompute_moe"}
        # the d_wide64 arm's FLOPs use its own, wider d_wide
        w64 = -(-s["d_wide"] // 64) * 64
        assert shape["flops"]["model"]["aoe-d_wide64"] == fl.training_flops(fl.aoe_block_forward_flops(
            tokens=s["tokens"], d_model=s["d_model"], num_experts=s["num_experts"],
            top_k=s["top_k"], d_low=s["d_low"], d_wide=w64))

    tiny = res["model"]["models"]["tiny"]
    # MFU against a 512^3 matmul measured in the run (--quick); no datasheet peak on the CPU
    assert res["model"]["matmul_peak_flops"] > 0 and res["model"]["matmul_n"] == 512
    assert res["model"]["datasheet_peak_flops"] is None
    for arch in ("moe", "aoe"):
        a = tiny["archs"][arch]
        assert a["tokens_per_s"] > 0 and a["mfu_matmul"] > 0 and a["mfu_datasheet"] is None
    # --model-archs, in its order; each arch's peak, the loop arch's overrides, ratios to moe
    assert list(tiny["archs"]) == ["moe", "aoe", "aoe-loop"]
    assert all(a["peak_bytes"] is not None for a in tiny["archs"].values())
    assert tiny["archs"]["aoe-loop"]["arch_overrides"] == {"aoe": {"expert_backend": "loop"}}
    assert set(tiny["ratios"]) == {"aoe", "aoe-loop"}

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
    assert "| MFU vs matmul | MFU vs datasheet |" in md and "a 512x512x512 matmul" in md
    assert "| tiny64 | aoe-naive |" in md and "## Expert parallel (EP=2)" in md
    assert f"`aoe-bench --quick --model-archs moe,aoe,aoe-loop --out {tmp_path}`" in md
    assert "| tiny | aoe-loop | 2 x 64 x 2 |" in md and "| tiny | aoe-loop/moe |" in md


def _eq5(d_model, d_ffn, d_low):
    return math.ceil((3 * d_model * d_ffn - d_low * d_model) / (d_low + 2 * d_model))


def _aoe_expert_params(d_model, d_low, d_wide):  # W_down^i, W_up^i, W_p^i, W_o^i
    return d_model * d_low + d_low * d_wide + 2 * d_model * d_wide


def test_d_wide_rounding_arms_and_their_parameters_at_the_paper_shapes():
    from aoe_megatron.bench.arms import SHAPES, arm_d_wide, arms_for, expert_params

    s4b = SHAPES["4b"]
    assert _eq5(1280, 5120, 400) == s4b.d_wide == 6470
    widths = {arm: arm_d_wide(s4b, arm) for arm in ("aoe", "aoe-d_wide64", "aoe-d_wide64-nearest")}
    assert widths == {"aoe": 6470, "aoe-d_wide64": 6528, "aoe-d_wide64-nearest": 6464}
    for arm, w in widths.items():
        assert expert_params(s4b, arm) == _aoe_expert_params(1280, 400, w), arm
    assert expert_params(s4b, "moe") == 3 * 1280 * 5120
    # nearest: 0.08% fewer parameters than MoE's expert; up: 0.9% more
    assert expert_params(s4b, "aoe-d_wide64-nearest") < expert_params(s4b, "moe")
    cpu = dict(device="cpu", dtype=torch.float32)
    assert {"aoe-d_wide64", "aoe-d_wide64-nearest"} <= set(arms_for(s4b, **cpu))
    # 732m: Eq. 5 gives 3840 = 60 * 64, so neither rounded arm is measured
    assert not {"aoe-d_wide64", "aoe-d_wide64-nearest"} & set(arms_for(SHAPES["732m"], **cpu))
    assert arms_for(s4b, **cpu, wanted=["moe", "aoe-naive"]) == ["moe", "aoe-naive"]


def test_ep8_per_rank_shapes_give_one_expert_the_rows_of_k_experts():
    from aoe_megatron.bench.arms import NAMED_ONLY_SHAPES, QUICK_SHAPES, SHAPES, per_rank

    for name in ("732m", "4b"):
        full, rank = SHAPES[name], SHAPES[f"{name}-ep8"]
        assert (rank.num_experts, rank.top_k, rank.tokens) == (1, 1, 4096 * 2), name
        assert (rank.d_model, rank.d_ffn, rank.d_low, rank.d_wide) == (
            full.d_model, full.d_ffn, full.d_low, full.d_wide)
    fine = per_rank(SHAPES["fine64"], ep=8)  # 8 local experts, top-8 of them: T K rows again
    assert (fine.num_experts, fine.top_k, fine.tokens * fine.top_k) == (8, 8, 4096 * 8)
    with pytest.raises(ValueError, match="do not split over EP=3"):
        per_rank(SHAPES["732m"], ep=3)
    assert set(NAMED_ONLY_SHAPES) <= set(SHAPES) | set(QUICK_SHAPES)


def test_model_level_defaults_leave_gpu_only_models_out_on_cpu():
    from aoe_megatron.bench import model

    assert model.MODELS["732m-4l"] == ("732m", {"num_layers": 4}, 4)  # the preset's 2048 tokens
    assert model.default_models(quick=False, device="cpu") == ["tiny", "732m-2l"]  # not 732m-4l
    assert model.default_models(quick=False, device="cuda") == list(model.MODELS)
    assert model.default_models(quick=True, device="cuda") == ["tiny"]
    with pytest.raises(ValueError, match="needs arch 'moe'"):
        model.run(quick=True, device="cpu", dtype=torch.float32, use_te=False, reps=1,
                  archs=("aoe", "aoe-loop"))


def test_new_flags_refuse_unknown_names(capsys):
    from aoe_megatron.cli import bench as cli

    _, args = cli.parse_args(["--arms", "aoe-d_wide64-nearest", "--model-archs", "moe,aoe-loop"])
    assert args.arms == ["aoe-d_wide64-nearest"] and args.model_archs == ["moe", "aoe-loop"]
    assert cli.parse_args([])[1].model_archs == ["moe", "aoe"]
    for flags, message in (
            (["--arms", "aoe,bogus"], "--arms: unknown ['bogus']; choose from moe,moe-grouped,aoe,"),
            (["--models", "732m-8l"], "--models: unknown ['732m-8l']; choose from tiny,732m-2l,"),
            (["--quick", "--models", "732m-4l"], "with --quick choose from tiny"),
            (["--model-archs", "moe,aoe-fast"], "--model-archs: unknown ['aoe-fast']"),
            (["--model-archs", "aoe,aoe-loop"], "--model-archs must include moe")):
        with pytest.raises(SystemExit) as exc:
            cli.parse_args(flags)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and message in err, (flags, err)


@pytest.mark.slow
def test_arms_flag_and_the_d_wide_and_parameter_columns(tmp_path):
    out = _run([sys.executable, "-m", "aoe_megatron.cli.bench", "--quick", "--only", "layer",
                "--shapes", "tiny64", "--arms", "aoe,aoe-d_wide64-nearest,aoe-grouped_mm", "--reps", "1",
                "--out", str(tmp_path)])
    # tiny64's d_wide 42 is no 16-byte multiple in fp32: grouped_mm is dropped, and said so
    assert "[layer tiny64] time: dropping aoe-grouped_mm: torch._grouped_mm cannot" in out.stdout
    res = json.loads((tmp_path / "results.json").read_text())["layer"]["tiny64"]
    assert list(res["arms"]) == ["moe", "aoe", "aoe-d_wide64-nearest"]  # moe: always
    d, f, r = 64, 32, 8
    w = _eq5(d, f, r)
    assert w == 42  # 42 / 64 = 0.66: the nearest multiple of 64 is 64
    moe = 3 * d * f
    want = {"aoe": (w, _aoe_expert_params(d, r, w)),
            "aoe-d_wide64-nearest": (64, _aoe_expert_params(d, r, 64))}
    assert res["experts"]["moe"] == {"d_wide": None, "d_ffn": f, "params": moe,
                                     "params_vs_moe": 1.0}
    for arm, (width, params) in want.items():
        e = res["experts"][arm]
        assert (e["d_wide"], e["params"]) == (width, params), arm
        assert e["params_vs_moe"] == pytest.approx(params / moe)
    assert "time_d_wide64_nearest" in res["ratios"]["targets"]
    md = (tmp_path / "README.md").read_text()
    assert ("| shape | arm | wall ms | CPU ms | saved MiB | peak MiB | GFLOP model (hw) | d_wide | "
            "params/expert | vs moe |") in md
    for arm, width, params in (("moe", "(d_ffn 32)", moe), *((a, *v) for a, v in want.items())):
        row = next(line for line in md.splitlines() if line.startswith(f"| tiny64 | {arm} | "))
        assert row.endswith(f"| {width} | {params:,} | {params / moe:.4f} |"), row


# --model-archs: test_quick_run_end_to_end (moe,aoe,aoe-loop) checks the columns and rows it writes.
