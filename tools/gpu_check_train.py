"""tools/gpu_check.py's training measurements outside the default set (issue #20; both have run on
an H200, bench/gpu_check/README.md): bf16 gradient accumulation in fp32 against bf16, and the host
memory of a checkpoint save and load. Each takes the ``Check`` that runs it and its time limit."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from gpu_check_steps import run_driver  # tools/

#: Tiny model, 64 micro-batches a step (the 732M recipe's count on 8 GPUs): global 128, micro 2.
ACCUMULATION = ["--preset", "tiny", "--mock-data", "--global-batch-size", "128",
                "--micro-batch-size", "2", "--eval-interval", "0", "--log-interval", "1",
                "--lr-warmup-iters", "2", "--precision", "bf16"]


def bf16_accumulation(check, timeout: float) -> dict:
    """The same bf16 run (same seed and batches) with gradients accumulated over 64 micro-batches
    in fp32 (the default) and in bf16, in one job (tools/gpu_check_runs.py): their losses."""
    steps = 20 if check.mode == "cuda" else 1  # the CPU form: that the step runs
    # the CPU form: 4 micro-batches a step, not 64 (the accumulation path is the same), and a
    # 512-token vocabulary (the 32k one is about 90% of the tiny model's parameters)
    batch = [] if check.mode == "cuda" else ["--global-batch-size", "8", "--set", "vocab_size=512"]
    runs = [{"name": dtype, "args": [*ACCUMULATION, *batch, "--train-iters", steps,
                                     "--grad-accum-dtype", dtype,
                                     "--run-dir", check.work / "accumulation" / dtype]}
            for dtype in ("fp32", "bf16")]
    res = run_driver(check, "accumulation", runs, nproc=1, timeout=timeout)
    losses = {dtype: [v for _, v in sorted((int(k), v) for k, v in r["losses"].items())]
              for dtype, r in res["runs"].items()}
    diffs = [b - f for f, b in zip(losses["fp32"], losses["bf16"])]
    return {"figures": {"micro_batches_per_step": 64 if check.mode == "cuda" else 4, "steps": steps,
                        "loss_fp32_accumulation": [round(v, 5) for v in losses["fp32"]],
                        "loss_bf16_accumulation": [round(v, 5) for v in losses["bf16"]],
                        "final_loss_difference": round(diffs[-1], 5),
                        "max_abs_loss_difference": round(max(map(abs, diffs)), 5)}}


def checkpoint_memory(check, timeout: float) -> dict:
    """tools/ckpt_memory.py at world 1 on the 142M-parameter model, its state on the GPU. The CPU
    form skips it: the CPU figures come from that tool at world 2 (bench/ckpt_memory/)."""
    if check.mode != "cuda":
        return {"status": "skipped", "reason": "CUDA-only: the CPU measurement is "
                "bench/ckpt_memory (tools/ckpt_memory.py --world 2)"}
    out = Path(tempfile.mkdtemp(prefix="aoe-gpu-check-mem-", dir=check.work)) / "memory.json"
    check.run([sys.executable, "tools/ckpt_memory.py", "--world", "1", "--out", out],
              timeout=timeout)
    result = json.loads(out.read_text())
    return {"figures": {k: result[k] for k in ("parameters", "optimizer_state_gib",
                                                "save_peak_gib", "load_peak_gib")}}
