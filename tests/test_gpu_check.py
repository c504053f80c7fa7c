"""tools/gpu_check.sh, the one-shot GPU check, in its CPU form: every step runs at tiny shapes and
writes the same results file a GPU run writes, the CUDA-only steps skipped with their reasons;
and the parts of its GPU path a CPU can show (the datasheet peaks, the backend switch and NCCL's
host id per rank, how a refusal by NCCL is told from another failure)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from aoe_megatron.runtime.versions import installed_mcore

ROOT = Path(__file__).resolve().parents[1]
GPU_RELEASE = "0.19.2"  # tools/gpu_check.sh's default (GPU_CHECK_MCORE), its wheels' release
STEPS = ["environment", "gpu-tests", "ep-nccl", "layer", "train-732m", "activations-4b",
         "ep-nccl-zero2", "bf16-accumulation", "checkpoint-memory"]


def _check(tmp_path, *flags, timeout=600, **env):
    # this leg's Python and megatron-core (the script's default is 0.19.2's virtualenv)
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PY": sys.executable,
           "GPU_CHECK_MCORE": installed_mcore(), **env}
    env.pop("OUT", None)
    return subprocess.run(["bash", "tools/gpu_check.sh", *flags, "--out", str(tmp_path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.legs
@pytest.mark.skipif(installed_mcore() != GPU_RELEASE,
                    reason=f"runs on the second CI leg (make test-mcore019): the GPU machine runs the "
                           f"check on Python 3.12 with megatron-core {GPU_RELEASE}")
def test_cpu_form_runs_every_step_and_writes_the_results(tmp_path):
    """Started from inside a launched job (its rendezvous port taken, as pytest's own process
    group holds it): each step is a job of its own all the same. The steps outside the default
    set are recorded as skipped (test_steps_outside_the_default_set_* below).

    On the second CI leg only, the check's own environment (the first leg has every other test of
    the check; the steps' code paths are the suite's own, tested on both)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done = _check(tmp_path, "--cpu", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(taken.getsockname()[1]), RANK="0", WORLD_SIZE="1")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    steps = {s["name"]: s for s in results["steps"]}
    assert [s["name"] for s in results["steps"]] == STEPS
    assert results["mode"] == "cpu" and results["ok"] is True
    env = steps["environment"]["figures"]
    assert env["device"] == "cpu" and env["fused_softmax"] is False
    assert env["datasheet_bf16_peak"][0] is None  # no datasheet figure for a CPU

    gpu_tests = steps["gpu-tests"]
    assert gpu_tests["status"] == "skipped" and gpu_tests["reason"].startswith("CUDA-only")

    ep = steps["ep-nccl"]
    assert ep["status"] == "ok", ep
    f = ep["figures"]
    assert f["backend"] == "gloo" and f["verify_exit_codes"] == [0, 0]
    assert sorted(f["seconds"]) == sorted(f"{a}-{r}" for a in ("aoe", "moe")
                                         for r in ("ep1", "ep2", "resumed"))
    for arch in ("aoe", "moe"):
        assert f[arch]["max_resume_loss_diff"] <= 1e-5  # the same layout resumed: exact on CPU
        d = f[arch]["ep1_vs_ep2"]
        assert d["steps"] == [1, 2, 3, 4] and d["loss_diff_step1"] <= 1e-4
        assert d["max_loss_diff"] <= f["tolerances"]["loss"]
        assert 6 < f[arch]["losses_ep2"][0] < 6.5  # ln(512) = 6.24 at the start
    assert steps["ep-nccl-zero2"]["status"] == "skipped"
    assert steps["ep-nccl-zero2"]["reason"].startswith("CUDA form only")

    layer = steps["layer"]
    assert layer["status"] == "ok", layer
    blocks, skipped = layer["figures"]["blocks"], layer["figures"]["skipped"]
    asked = {f"{s}/{a}" for s in ("tiny8", "tiny8-ep8")
             for a in ("moe", "aoe", "moe-grouped", "aoe-grouped_mm", "aoe-d_wide64-nearest")}
    assert asked <= set(blocks) | set(skipped)  # each block measured, or skipped with why
    assert {"tiny8/moe", "tiny8/aoe", "tiny8-ep8/moe", "tiny8-ep8/aoe"} <= set(blocks)
    assert blocks["tiny8/moe"]["experts"].endswith("SequentialMLP")
    assert all(b["ms"] > 0 and b["time_vs_moe"] > 0 for b in blocks.values())
    assert all(why for why in skipped.values())

    train = steps["train-732m"]
    assert train["status"] == "ok", train
    f = train["figures"]
    assert f["datasheet_peak_tflops"] is None and "CPU" in f["datasheet_note"]
    assert f["matmul_peak_tflops"] > 0 and f["matmul_n"] == 256
    for arch in ("aoe", "moe"):
        a = f[arch]
        assert a["tokens_per_step"] == 4 * 64 and a["tokens_per_s"] > 0
        assert 0 < a["mfu_vs_matmul"] and a["mfu_vs_datasheet"] is None
        assert a["cuda_max_allocated_gib"] is None  # CUDA only
    assert f["aoe_tokens_per_s_vs_moe"] > 0

    act = steps["activations-4b"]
    assert act["status"] == "ok", act
    f = act["figures"]
    assert f["preset"] == "tiny" and f["micro_batch"] == 2
    for arch in ("aoe", "moe"):
        assert f[arch]["saved_mib_per_layer"] > 0 and f[arch]["allocated_mib_per_layer"] is None
        assert set(f[arch]["saved_mib_over_layers"]) == {"1", "2"}
    assert f["aoe"]["vs_moe"]["saved_per_layer"] > 0

    for name in ("bf16-accumulation", "checkpoint-memory"):
        assert steps[name]["status"] == "skipped"
        assert steps[name]["reason"].startswith("not in the default set"), steps[name]
    log = (tmp_path / "gpu_check.log").read_text()
    assert "resumed from" in log and "== layer: ok" in log


def test_gpu_form_without_cuda_stops_at_the_environment_step(tmp_path):
    done = _check(tmp_path, timeout=120)
    assert done.returncode == 1
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert results["ok"] is False and [s["name"] for s in results["steps"]] == ["environment"]
    assert "torch sees no CUDA device" in results["steps"][0]["reason"]


def test_the_check_runs_megatron_core_0192_unless_told_and_refuses_another_release(tmp_path):
    """GPU_CHECK_MCORE defaults to 0.19.2; a Python whose megatron-core is another release is
    refused before any step, naming the way out."""
    from aoe_megatron.runtime.versions import installed_mcore

    env = {k: v for k, v in os.environ.items() if k != "GPU_CHECK_MCORE"}
    other = {"0.16.1": "0.19.2", "0.19.2": "0.16.1"}[installed_mcore()]
    if other != "0.19.2":  # on the 0.16.1 leg the default itself is the other release
        env["GPU_CHECK_MCORE"] = other
    done = subprocess.run(["bash", "tools/gpu_check.sh", "--out", str(tmp_path)], cwd=ROOT,
                          env={**env, "PY": sys.executable}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert (f"has megatron-core {installed_mcore()}, not {other} (GPU_CHECK_MCORE): set "
            f"GPU_CHECK_MCORE={installed_mcore()}") in done.stderr, done.stderr
    assert not (tmp_path / "gpu_check.json").exists()


def test_pytest_summary_found_above_a_shutdown_warning():
    """The first H200 run (2026-12-04): 4 gpu-marked tests passed, then NCCL's shutdown warning
    came last, and the check took the warning for the summary and failed the step."""
    from tests.helpers import load_tool

    gpu_check = load_tool("gpu_check")
    output = ("....    [100%]\n-- Docs: https://docs.pytest.org/\n"
              "4 passed, 104 deselected, 1 warning in 18.37s\n"
              "[rank0]:[W1204 17:13:54.036369626 ProcessGroupNCCL.cpp:1575] Warning: WARNING: "
              "destroy_process_group() was not called before program exit\n")
    assert gpu_check._pytest_summary(output) == "4 passed, 104 deselected, 1 warning in 18.37s"
    with pytest.raises(RuntimeError, match="no summary"):
        gpu_check._pytest_summary("Traceback (most recent call last):\nImportError: x\n")


def test_datasheet_peaks_by_device_name():
    """MFU's datasheet denominator: dense bf16 by the words of the device's name; a board the
    table does not rate (NVL, GH200, a name that only contains A100's letters) gets None."""
    from aoe_megatron.bench.measure import datasheet_peak_flops

    for name, tflops in (("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756),
                         ("NVIDIA H200", 989), ("NVIDIA A100-SXM4-80GB", 312),
                         ("NVIDIA A100-PCIE-40GB", 312), ("NVIDIA H100 NVL", None),
                         ("NVIDIA H200 NVL", None), ("NVIDIA RTX A1000", None), ("cpu", None)):
        flops, note = datasheet_peak_flops(name, torch.bfloat16)
        assert flops == (tflops and tflops * 1e12), (name, note)
    assert datasheet_peak_flops("NVIDIA H200", torch.float32)[0] is None


def test_backend_forced_and_one_nccl_host_per_rank(monkeypatch):
    """ep-nccl's two switches: AOE_DIST_BACKEND picks the backend; with NCCL and
    AOE_NCCL_HOST_PER_RANK=1 each rank gets its own NCCL_HOSTID, from RANK (LOCAL_RANK is the
    device index by then, the same on every rank of one GPU)."""
    from aoe_megatron.runtime import distributed

    monkeypatch.delenv("NCCL_HOSTID", raising=False)
    monkeypatch.setenv("AOE_DIST_BACKEND", "gloo")
    monkeypatch.setenv("AOE_NCCL_HOST_PER_RANK", "1")
    assert distributed.default_backend() == "gloo" and "NCCL_HOSTID" not in os.environ
    monkeypatch.setenv("AOE_DIST_BACKEND", "nccl")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert distributed.default_backend() == "nccl"
    assert os.environ["NCCL_HOSTID"] == f"{socket.gethostname()}-rank1"
    monkeypatch.setenv("AOE_DIST_BACKEND", "mpi")
    with pytest.raises(ValueError, match="expected nccl or gloo"):
        distributed.default_backend()


def test_nccl_refusal_told_from_other_failures(monkeypatch):
    """Only a job that failed before any run ended, naming NCCL or hanging, falls back to gloo:
    a failure after a run ended, or one that does not name NCCL, fails the step."""
    from tests.helpers import load_tool

    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    ep = load_tool("gpu_check_ep")
    fail = lambda output, runs=(), timed_out=False: SimpleNamespace(  # noqa: E731
        output=output, timed_out=timed_out, partial={"runs": dict.fromkeys(runs, {})})
    refused = ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, "
               "invalid usage\nNCCL WARN Duplicate GPU detected : rank 1 and rank 0 both on "
               "CUDA device 1a000")
    assert "Duplicate GPU detected" in ep._refusal(fail(refused))
    assert ep._refusal(fail(refused, runs=["aoe-ep2"])) is None  # NCCL ran a run: not a refusal
    assert ep._refusal(fail("AssertionError: shapes differ")) is None
    assert "hung" in ep._refusal(fail("step 1/8", timed_out=True))


class _FakeCheck:
    """A Check that runs nothing: ``run`` answers from ``answers`` in turn (an exception raised,
    or a callable given the command)."""

    def __init__(self, tmp_path, answers, mode="cpu"):
        self.mode, self.out, self.work = mode, tmp_path / "out", tmp_path / "work"
        self.answers, self.commands = list(answers), []

    def run(self, cmd, *, timeout, env=None):
        self.commands.append([str(c) for c in cmd])
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer(cmd)

    def say(self, msg):
        pass


def _tools(monkeypatch, name):
    from tests.helpers import load_tool

    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    return load_tool(name)


def test_steps_outside_the_default_set_build_their_figures(tmp_path, monkeypatch):
    """bf16-accumulation's two runs in one driver job, its figures from the driver's results;
    checkpoint-memory skips on the CPU. (Their processes are the driver's and the trainer's,
    which the CPU form's ep-nccl and train-732m run.)"""
    train = _tools(monkeypatch, "gpu_check_train")
    jobs = []

    def fake_driver(check, name, runs, *, nproc, timeout, **kw):
        jobs.append((name, [r["name"] for r in runs], nproc, runs[0]["args"]))
        return {"runs": {"fp32": {"losses": {"1": 6.25}}, "bf16": {"losses": {"1": 6.2501}}}}

    monkeypatch.setattr(train, "run_driver", fake_driver)
    check = _FakeCheck(tmp_path, [])
    figures = train.bf16_accumulation(check, 60)["figures"]
    assert jobs[0][:3] == ("accumulation", ["fp32", "bf16"], 1)
    assert "--grad-accum-dtype" in jobs[0][3] and "vocab_size=512" in jobs[0][3]
    assert figures["micro_batches_per_step"] == 4 and figures["steps"] == 1
    assert figures["loss_fp32_accumulation"] == [6.25] and figures["final_loss_difference"] == 1e-4
    assert train.checkpoint_memory(check, 60)["status"] == "skipped"


def test_layer_step_records_names_the_bench_does_not_have(tmp_path, monkeypatch):
    """A shape or arm the layer bench does not know (its command line refuses it) is recorded as
    skipped and the bench run again without it; an arm it drops at a shape, with its reason."""
    steps = _tools(monkeypatch, "gpu_check_steps")
    refused = RuntimeError("exit 2")
    refused.output = "aoe-bench: error: --arms: unknown ['moe-grouped']; choose from moe,aoe\n"

    def bench(cmd):
        out = Path(cmd[cmd.index("--out") + 1])
        out.mkdir(parents=True)
        arm = {"time_s": {"median": 0.002}, "experts_class": "SequentialMLP"}
        shape = {"arms": {"moe": arm, "aoe": arm}, "ratios": {"aoe": {"time": 1.1, "flops": 1.08}},
                 "skipped_arms": {"aoe-grouped_mm": "torch._grouped_mm cannot run it"}}
        (out / "results.json").write_text(json.dumps({"layer": {"tiny8": shape,
                                                                "tiny8-ep8": shape}}))
        return ""

    # gpu_check.sh names a megatron-core 0.16.1 Python for this step (moe-grouped's release)
    monkeypatch.setenv("GPU_CHECK_LAYER_PY", "/older/python")
    check = _FakeCheck(tmp_path, [refused, bench])
    figures = steps.layer(check, 60)["figures"]
    assert check.commands[0][0] == check.commands[1][0] == "/older/python"
    assert "moe-grouped" in check.commands[0][check.commands[0].index("--arms") + 1]
    assert "moe-grouped" not in check.commands[1][check.commands[1].index("--arms") + 1]
    assert figures["skipped"]["*/moe-grouped"] == "the layer bench has no such arm"
    assert figures["skipped"]["tiny8/aoe-grouped_mm"] == "torch._grouped_mm cannot run it"
    assert "tiny8/aoe-d_wide64-nearest" in figures["skipped"]  # dropped without a reason
    assert figures["blocks"]["tiny8/aoe"] == {"ms": 2.0, "time_vs_moe": 1.1, "flops_vs_moe": 1.08,
                                              "experts": "SequentialMLP"}
