"""tools/gpu_check.py's measuring steps (issue #34): the layer bench's blocks, the 732M model
through the real trainer, activation memory per layer at 4B; and the driver both training steps
use (tools/gpu_check_runs.py: several trainer runs in one launched job). Each step takes the
``Check`` that runs it and its time limit in seconds; the expert-parallel steps are in
gpu_check_ep.py."""

from __future__ import annotations

import ast
import json
import os
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DRIVER = REPO / "tools" / "gpu_check_runs.py"
GIB = 2 ** 30

#: The layer step's blocks (``aoe_megatron.bench.arms``) and arms; moe, megatron-core's
#: SequentialMLP (``--te off``), always runs. aoe-d_wide64-nearest is the 4B preset's width (6464,
#: on grouped_mm; Eq. 5's 6470 is not 16-byte aligned, so aoe-grouped_mm drops out at 4b). The CPU
#: form adds aoe. An arm the bench cannot run at a shape (moe-grouped on megatron-core 0.19.2
#: without TransformerEngine) is recorded as skipped, with the bench's reason.
LAYER = {"cuda": {"shapes": ["732m", "4b", "732m-ep8", "4b-ep8"],
                  "arms": ["moe-grouped", "aoe-grouped_mm", "aoe-d_wide64-nearest"],
                  "flags": ["--device", "cuda", "--dtype", "bf16", "--te", "off", "--reps", "5"]},
         "cpu": {"shapes": ["tiny8", "tiny8-ep8"],
                 "arms": ["aoe", "moe-grouped", "aoe-grouped_mm", "aoe-d_wide64-nearest"],
                 "flags": ["--device", "cpu", "--quick"]}}
#: the bench's answer to a name it does not have ("--arms: unknown ['x']; choose from ...")
UNKNOWN_NAMES = re.compile(r"(--arms|--shapes): unknown (\[[^\]]*\])")

#: train-732m: the 732M preset (12 layers) at world 1, bf16 (ZeRO-1: DeepSpeed's BF16_Optimizer),
#: mock data, micro-batch 4 x 2 accumulated = 16,384 tokens a step; the first WARM steps are left
#: out of the median step time. CPU: the tiny preset, 3 steps, a 512-token vocabulary (the 32k
#: one is about 90% of the tiny model's parameters).
TRAIN = {"cuda": (["--preset", "732m", "--global-batch-size", "8", "--micro-batch-size", "4",
                   "--train-iters", "10"], 2, 8192),
         "cpu": (["--preset", "tiny", "--set", "vocab_size=512", "--global-batch-size", "4",
                  "--micro-batch-size", "2", "--train-iters", "3"], 1, 256)}
TRAIN_COMMON = ["--mock-data", "--precision", "bf16", "--zero-stage", "1", "--eval-interval", "0",
                "--log-interval", "5", "--lr-warmup-iters", "1"]


def driver_command(spec: Path, nproc: int) -> list:
    """tools/gpu_check_runs.py in ``nproc`` processes, started as ``runtime.launch.command`` starts
    the trainer (torchrun --standalone from two processes on), the script in place of the module."""
    if nproc == 1:
        return [sys.executable, DRIVER, spec]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            str(nproc), DRIVER, spec]


def run_driver(check, name: str, runs: list, *, nproc: int, timeout: float, env=None,
               verify=(), matmul_n=None) -> dict:
    """The driver's results for ``runs`` ([{"name", "args", "resume_from"?}]) in a job of
    ``nproc`` processes; a failure raises gpu_check's ``CommandFailed`` (``output``), with
    ``partial``: the results of the runs done."""
    work = check.work / name
    work.mkdir(parents=True, exist_ok=True)
    out, spec = work / "runs.json", work / "spec.json"
    runs = [{**r, "args": [str(a) for a in r["args"]]} for r in runs]
    spec.write_text(json.dumps({"out": str(out), "runs": runs, "verify": [str(v) for v in verify],
                                "matmul_n": matmul_n}, default=str))
    # NOTE: one intra-op thread a process on the CPU: on a busy 2-core machine two threads made
    # each tiny bf16 step 10x slower (1.5 s against 0.12 s), spinning against the other load
    threads = {"OMP_NUM_THREADS": "1"} if check.mode == "cpu" else {}
    try:
        check.run(driver_command(spec, nproc), timeout=timeout, env={**threads, **(env or {})})
    except RuntimeError as err:
        if not hasattr(err, "output"):  # CommandFailed (gpu_check.py runs as __main__)
            raise
        err.partial = json.loads(out.read_text()) if out.is_file() else {"runs": {}}
        raise
    return json.loads(out.read_text())


def layer(check, timeout: float) -> dict:
    """The layer bench's blocks (DIR/layer/): time per arm and against moe; a shape or arm the
    bench does not have (its command line says which), or drops at a shape, is listed under
    "skipped" with why."""
    want = LAYER[check.mode]
    shapes, arms, skipped = list(want["shapes"]), list(want["arms"]), {}
    # tools/gpu_check.sh may name a megatron-core 0.16.1 Python for this step (moe-grouped, the
    # legacy grouped GEMM, is gone from later releases)
    python = os.environ.get("GPU_CHECK_LAYER_PY") or sys.executable
    env = ({"PYTHONPATH": os.environ["GPU_CHECK_LAYER_PYTHONPATH"]}
           if os.environ.get("GPU_CHECK_LAYER_PYTHONPATH") else None)
    while True:
        try:
            check.run([python, "-m", "aoe_megatron.cli.bench", *want["flags"], "--only",
                       "layer", "--shapes", ",".join(shapes), "--arms", ",".join(arms or ["moe"]),
                       "--out", check.out / "layer"], timeout=timeout, env=env)
            break
        except RuntimeError as err:
            unknown = UNKNOWN_NAMES.search(getattr(err, "output", ""))
            if unknown is None:
                raise
            flag, names = unknown.group(1), ast.literal_eval(unknown.group(2))
            kind = "arm" if flag == "--arms" else "shape"
            skipped.update({(f"*/{n}" if kind == "arm" else f"{n}/*"):
                            f"the layer bench has no such {kind}" for n in names})
            arms = [a for a in arms if a not in names]
            shapes = [s for s in shapes if s not in names]
            if not shapes:
                return {"status": "skipped", "reason": "the layer bench has none of the shapes",
                        "figures": {"skipped": skipped}}
    results = json.loads((check.out / "layer" / "results.json").read_text())
    res, release = results["layer"], results.get("machine", {}).get("megatron_core")
    blocks = {}
    for shape, s in res.items():
        for arm, a in s["arms"].items():
            r = s["ratios"].get(arm, {})
            blocks[f"{shape}/{arm}"] = {
                "ms": round(a["time_s"]["median"] * 1e3, 3), "time_vs_moe": r.get("time", 1.0),
                "flops_vs_moe": round(r.get("flops", 1.0), 4), "experts": a.get("experts_class")}
        for arm in arms:
            if arm not in s["arms"]:
                skipped[f"{shape}/{arm}"] = s.get("skipped_arms", {}).get(
                    arm, "the bench left it out without saying why")
    return {"figures": {"megatron_core": release, "blocks": blocks, "skipped": skipped}}


def train_732m(check, timeout: float) -> dict:
    """aoe and moe through the trainer (one job, world 1): tokens/s, peak CUDA memory, MFU."""
    settings, warm, n = TRAIN[check.mode]
    runs = [{"name": arch, "args": [*settings, *TRAIN_COMMON, "--arch", arch,
                                    "--run-dir", check.work / "train" / arch]}
            for arch in ("aoe", "moe")]
    res = run_driver(check, "train", runs, nproc=1, timeout=timeout, matmul_n=n)
    matmul, sheet = res["matmul"]["flops"], res["datasheet"]["flops"]
    figures = {"device": res["device"], "matmul_peak_tflops": round(matmul / 1e12, 3),
               "matmul_n": n, "datasheet_peak_tflops": sheet and sheet / 1e12,
               "datasheet_note": res["datasheet"]["note"], "warm_up_steps_left_out": warm}
    for arch, r in res["runs"].items():
        step_s = statistics.median(r["step_seconds"][warm:])
        achieved = r["model_flops_per_step"] / step_s
        peak = r.get("cuda_max_allocated")
        figures[arch] = {
            "tokens_per_step": r["tokens_per_step"], "step_s_median": round(step_s, 4),
            "tokens_per_s": round(r["tokens_per_step"] / step_s, 1),
            "model_tflops_per_step": round(r["model_flops_per_step"] / 1e12, 4),
            "mfu_vs_datasheet": sheet and round(achieved / sheet, 4),
            "mfu_vs_matmul": round(achieved / matmul, 4),
            "cuda_max_allocated_gib": peak and round(peak / GIB, 3),
            # what the run before it left allocated (0 unless something kept it alive)
            "cuda_allocated_at_start_gib": peak and round(r["cuda_allocated_at_start"] / GIB, 3),
            "final_loss": r["losses"][str(max(map(int, r["losses"])))]}
    figures["aoe_tokens_per_s_vs_moe"] = round(figures["aoe"]["tokens_per_s"] /
                                               figures["moe"]["tokens_per_s"], 3)
    return {"figures": figures}


def activations_4b(check, timeout: float) -> dict:
    """``aoe_megatron.bench.activations`` at the 4B shape (2 and 4 layers, micro-batch 2; the
    CPU form: tiny, 1 and 2 layers): bytes a training forward holds, per layer."""
    if check.mode == "cuda":
        args = ["--preset", "4b", "--layers", "2,4", "--device", "cuda"]
    else:
        args = ["--preset", "tiny", "--layers", "1,2", "--device", "cpu"]
    out = check.work / "activations.json"
    check.run([sys.executable, "-m", "aoe_megatron.bench.activations", *args, "--micro-batch", "2",
               "--dtype", "bf16", "--archs", "aoe,moe", "--out", out], timeout=timeout)
    res = json.loads(out.read_text())
    mib = lambda v: None if v is None else round(v / 2 ** 20, 2)  # noqa: E731
    figures = {"preset": res["preset"], "micro_batch": res["micro_batch"], "dtype": res["dtype"]}
    for arch, a in res["archs"].items():
        figures[arch] = {"allocated_mib_per_layer": mib(a["allocated_per_layer"]),
                         "saved_mib_per_layer": mib(a["saved_per_layer"]),
                         "allocated_mib_over_layers": {k: mib(v) for k, v in
                                                       a["allocated_over_layers"].items()},
                         "saved_mib_over_layers": {k: mib(v) for k, v in
                                                   a["saved_over_layers"].items()},
                         **({"vs_moe": a["vs_moe"]} if "vs_moe" in a else {})}
    return {"figures": figures}
