"""tools/gpu_check.sh, the one-shot GPU check, in its CPU form: every step runs at tiny shapes and
writes the same results file a GPU run writes, the CUDA-only step skipped with its reason."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["environment", "gpu-tests", "train-resume", "bf16-accumulation", "checkpoint-memory",
         "model", "layer"]


def _check(tmp_path, *flags, timeout=600, **env):
    from aoe_megatron.runtime.versions import installed_mcore

    # this leg's Python and megatron-core (the script's default is 0.19.2's virtualenv)
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PY": sys.executable,
           "GPU_CHECK_MCORE": installed_mcore(), **env}
    env.pop("OUT", None)
    return subprocess.run(["bash", "tools/gpu_check.sh", *flags, "--out", str(tmp_path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.distributed
@pytest.mark.slow
def test_cpu_form_runs_every_step_and_writes_the_results(tmp_path):
    """Started from inside a launched job (its rendezvous port taken, as pytest's own process
    group holds it): each step is a job of its own all the same."""
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
    assert steps["environment"]["figures"]["device"] == "cpu"
    assert steps["environment"]["figures"]["fused_softmax"] is False

    gpu_tests = steps["gpu-tests"]
    assert gpu_tests["status"] == "skipped" and gpu_tests["reason"].startswith("CUDA-only")
    assert gpu_tests["figures"]["skipped"] >= 4

    train = steps["train-resume"]
    assert train["status"] == "ok", train
    assert train["figures"]["world_size"] == 1
    assert train["figures"]["max_resume_loss_diff"] <= 1e-5
    assert 9 < train["figures"]["final_loss"] < 11  # ln(32000) = 10.4 at the start
    assert len(train["figures"]["resume_and_save_host_peak_gib"]) >= 2  # the load, each save

    accumulation = steps["bf16-accumulation"]
    assert accumulation["status"] == "ok", accumulation
    assert accumulation["figures"]["micro_batches_per_step"] == 4  # the CPU form; 64 on CUDA
    assert len(accumulation["figures"]["loss_fp32_accumulation"]) == accumulation["figures"]["steps"]
    memory = steps["checkpoint-memory"]
    assert memory["status"] == "skipped" and memory["reason"].startswith("CUDA-only")

    model = steps["model"]
    assert model["status"] == "ok", model
    assert set(model["figures"]) == {"tiny/moe", "tiny/aoe", "tiny/aoe-loop"}
    assert all(f["tokens_per_s"] > 0 for f in model["figures"].values())
    assert model["figures"]["tiny/moe"]["tokens_per_s_vs_moe"] == 1.0
    bench = json.loads((tmp_path / "model" / "results.json").read_text())["model"]["models"]["tiny"]
    assert list(bench["archs"]) == ["moe", "aoe", "aoe-loop"]  # --model-archs, in its order
    assert all(a["peak_bytes"] is not None for a in bench["archs"].values())
    assert bench["archs"]["aoe-loop"]["arch_overrides"] == {"aoe": {"expert_backend": "loop"}}
    assert set(bench["ratios"]) == {"aoe", "aoe-loop"}
    md = (tmp_path / "model" / "README.md").read_text()
    assert "| tiny | aoe-loop | 2 x 64 x 2 |" in md and "| tiny | aoe-loop/moe |" in md

    layer = steps["layer"]
    assert layer["status"] == "ok", layer
    assert {"tiny8/aoe", "tiny64/aoe"} <= set(layer["figures"])
    assert all(f["time_vs_moe"] > 0 for f in layer["figures"].values())
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
