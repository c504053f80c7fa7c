"""tools/gpu_check.py's training steps (issue #20): bf16 gradient accumulation in fp32 against
bf16, and the host memory of a checkpoint save and load. Each takes the ``Check`` that runs it."""

from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from aoe_megatron.runtime import launch

#: |resumed - uninterrupted| per step: bf16 GPU kernels may reduce in another order (atomics)
RESUME_TOLERANCE = {"cuda": 2e-2, "cpu": 1e-5}

#: Tiny model, 64 micro-batches a step (the 732M recipe's count on 8 GPUs): global 128, micro 2.
ACCUMULATION = ["--preset", "tiny", "--mock-data", "--global-batch-size", "128",
                "--micro-batch-size", "2", "--eval-interval", "0", "--log-interval", "1",
                "--lr-warmup-iters", "2", "--precision", "bf16"]


def _losses(run_dir: Path) -> dict:
    losses = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "train":
            losses[record["step"]] = record["loss"]
    return losses


def train_resume(check) -> dict:
    """12 steps saving at 6 and 12 (the CPU form: 6, saving at 3 and 6); then a copy of the middle
    checkpoint alone resumed to the end. In a scratch folder: the results folder holds results
    only (the device tool brings back 8 files)."""
    work = Path(tempfile.mkdtemp(prefix="aoe-gpu-check-"))
    steps = 12 if check.mode == "cuda" else 6
    half = steps // 2
    common = launch.command(["--preset", "tiny", "--mock-data", "--train-iters", steps,
                             "--save-interval", half, "--eval-interval", half,
                             "--log-interval", "1"])
    env = {"OMP_NUM_THREADS": "2"}
    t0 = time.perf_counter()
    check.run([*common, "--save", work / "ckpt", "--run-dir", work / "run"], timeout=300, env=env)
    first_s = time.perf_counter() - t0
    check.run([sys.executable, "-m", "aoe_megatron.cli.checkpoints", "verify", work / "ckpt"],
              timeout=120)
    middle = f"step_{half:08d}"
    resumed_ckpt = work / f"ckpt-from-{half}"
    shutil.copytree(work / "ckpt" / middle, resumed_ckpt / middle)
    (resumed_ckpt / "latest").write_text(middle + "\n")
    output = check.run([*common, "--load", resumed_ckpt, "--save", resumed_ckpt, "--run-dir",
                        work / "resumed"], timeout=300, env=env)
    if "resumed from" not in output:
        raise RuntimeError(f"the second run did not resume from step {half}")
    first, second = _losses(work / "run"), _losses(work / "resumed")
    if sorted(second) != list(range(half + 1, steps + 1)):
        raise RuntimeError(f"the resumed run logged steps {sorted(second)}, not {half + 1}-{steps}")
    diff = max(abs(first[s] - second[s]) for s in second)
    run = json.loads((work / "run" / "run.json").read_text())
    peaks = [float(x) for x in re.findall(r"host memory peak \+([\d.]+) GiB", output)]
    if not peaks:
        raise RuntimeError("the resumed run printed no host-memory figure for its load and save")
    figures = {"final_loss": first[steps], "max_resume_loss_diff": diff, "first_run_s": round(first_s, 1),
               "world_size": run["world_size"], "resume_and_save_host_peak_gib": peaks}
    shutil.rmtree(work, ignore_errors=True)
    if diff > RESUME_TOLERANCE[check.mode]:
        raise RuntimeError(f"resumed losses differ from the uninterrupted run's by {diff:.3g} "
                           f"(> {RESUME_TOLERANCE[check.mode]:g}): {figures}")
    return {"figures": figures}


def bf16_accumulation(check) -> dict:
    """The same bf16 run (same seed and batches) with gradients accumulated over 64 micro-batches
    in fp32 (the default) and in bf16: their losses, step by step."""
    steps = 20 if check.mode == "cuda" else 1  # the CPU form: that the step runs
    # the CPU form: 4 micro-batches a step, not 64 (the accumulation path is the same)
    batch = [] if check.mode == "cuda" else ["--global-batch-size", "8"]
    work = Path(tempfile.mkdtemp(prefix="aoe-gpu-check-accum-"))
    losses = {}
    for dtype in ("fp32", "bf16"):
        check.run(launch.command([*ACCUMULATION, *batch, "--train-iters", steps,
                                  "--grad-accum-dtype", dtype, "--run-dir", work / dtype]),
                  timeout=240, env={"OMP_NUM_THREADS": "2"})
        losses[dtype] = _losses(work / dtype)
    diffs = [losses["bf16"][s] - losses["fp32"][s] for s in sorted(losses["fp32"])]
    return {"figures": {"micro_batches_per_step": 64 if check.mode == "cuda" else 4, "steps": steps,
                        "loss_fp32_accumulation": [round(v, 5) for v in losses["fp32"].values()],
                        "loss_bf16_accumulation": [round(v, 5) for v in losses["bf16"].values()],
                        "final_loss_difference": round(diffs[-1], 5),
                        "max_abs_loss_difference": round(max(map(abs, diffs)), 5)}}


def checkpoint_memory(check) -> dict:
    """tools/ckpt_memory.py at world 1 on the 142M-parameter model, its state on the GPU. The CPU
    form skips it: the CPU figures come from that tool at world 2 (bench/ckpt_memory/), and the
    train-resume step already reads the trainer's own host-memory lines."""
    if check.mode != "cuda":
        return {"status": "skipped", "reason": "CUDA-only: the CPU measurement is "
                "bench/ckpt_memory (tools/ckpt_memory.py --world 2)"}
    out = Path(tempfile.mkdtemp(prefix="aoe-gpu-check-mem-")) / "memory.json"
    check.run([sys.executable, "tools/ckpt_memory.py", "--world", "1", "--out", out], timeout=300)
    result = json.loads(out.read_text())
    return {"figures": {k: result[k] for k in ("parameters", "optimizer_state_gib",
                                                "save_peak_gib", "load_peak_gib")}}
