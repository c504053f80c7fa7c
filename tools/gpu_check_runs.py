#!/usr/bin/env python
"""Several training runs in one launched job, for tools/gpu_check.py (issue #34).

    python tools/gpu_check_runs.py SPEC.json                     # world 1
    python -m torch.distributed.run --standalone --nproc_per_node 2 tools/gpu_check_runs.py SPEC.json

Imports, the process group and the CUDA contexts are paid once per job instead of once per run
(a launch costs about 20 s on the lent GPU machine, 5-10 s on 2 CPU cores). Each run goes through
the trainer's own ``train.loop.train`` with the run's command-line flags: a fresh model, engine,
schedule and data order, megatron-core's parallel state rebuilt at the run's EP size; a resume
builds all of it again and loads the checkpoint, as a restarted process would.

SPEC (JSON): {"out": results path, "runs": [{"name", "args": [trainer flags], "resume_from":
{"ckpt", "step", "into"} (optional: rank 0 copies the checkpoint of that step alone into a fresh
folder first)}], "verify": [checkpoint folders to re-hash after the runs], "matmul_n": n (optional:
time an n x n x n matmul at "matmul_dtype" afterwards)}. Rank 0 rewrites ``out`` after each run:
{"device", "runs": {name: {"losses", "grad_norms", "start", "seconds", "step_seconds",
"tokens_per_step", "model_flops_per_step", "cuda_max_allocated", "cuda_allocated_at_start"}},
"verify": {folder: exit code}, "matmul": {"n", "dtype", "flops"}, "datasheet": {"flops", "note"}}. Step times come from timing each call of the trainer's ``train_step``
(CUDA synchronized before and after). A failing run ends the job (exit non-zero); the results of
the runs before it are in ``out``.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _timed_steps(record: dict):
    """The trainer's ``train_step`` wrapped to time each call and keep its grad norm."""
    import torch

    from aoe_megatron.train import loop

    inner = loop.train_step

    def step(*args, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        began = time.perf_counter()
        result = inner(*args, **kwargs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        record["step_seconds"].append(time.perf_counter() - began)
        record["grad_norms"][result.step] = result.grad_norm
        return result

    return inner, step


def _model_flops(model, tokens: int) -> int:
    """The bench's model FLOPs of one step (``bench.flops.model_step_flops``: 6 N T + 12 L D S T)."""
    from aoe_megatron.bench.flops import model_step_flops
    from aoe_megatron.bench.model import matmul_params

    return model_step_flops(tokens=tokens, matmul_params=matmul_params(model),
                            num_layers=model.num_layers, d_model=model.hidden_size,
                            seq_length=model.seq_length)


def _copy_checkpoint(ckpt: Path, step: int, into: Path) -> None:
    """``into`` holding only ``ckpt``'s checkpoint of ``step`` (what a resume from it loads)."""
    from aoe_megatron.checkpoint.layout import LATEST, step_name, write_pointer

    name = step_name(step)
    shutil.rmtree(into, ignore_errors=True)
    shutil.copytree(ckpt / name, into / name)
    write_pointer(into, LATEST, name)


def _write(out: Path, results: dict) -> None:
    tmp = out.with_suffix(".partial")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    os.replace(tmp, out)


def main(spec_path: str) -> int:
    import torch
    import torch.distributed as dist

    from aoe_megatron.train import loop
    from aoe_megatron.train.launcher_env import adopt_single_process_env
    from aoe_megatron.train.run import parse_run

    spec = json.loads(Path(spec_path).read_text())
    adopt_single_process_env()  # world 1 without a launcher, as the trainer's entry point does
    rank0 = int(os.environ["RANK"]) == 0
    cuda = torch.cuda.is_available()
    out = Path(spec["out"])
    results = {"device": None, "runs": {}}  # named after the first run has set this rank's GPU
    for item in spec["runs"]:
        if "resume_from" in item:
            source = item["resume_from"]
            if rank0:
                _copy_checkpoint(Path(source["ckpt"]), int(source["step"]), Path(source["into"]))
            if dist.is_initialized():
                dist.barrier()
        run = parse_run([str(a) for a in item["args"]])
        record = {"step_seconds": [], "grad_norms": {}}
        if cuda:  # NOTE: before the first run this starts CUDA on device 0: the check's one GPU
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            record["cuda_allocated_at_start"] = torch.cuda.memory_allocated()
        inner, loop.train_step = _timed_steps(record)
        began = time.perf_counter()
        try:
            summary = loop.train(run)
        finally:
            loop.train_step = inner
        tokens = run.cfg.global_batch_size * run.model.seq_length
        record.update(seconds=time.perf_counter() - began, losses=summary["losses"],
                      start=summary["start"], tokens_per_step=tokens,
                      model_flops_per_step=_model_flops(run.model, tokens))
        if cuda:
            record["cuda_max_allocated"] = torch.cuda.max_memory_allocated()
        results["device"] = torch.cuda.get_device_name() if cuda else "cpu"
        results["runs"][item["name"]] = record
        if rank0:
            _write(out, results)
    if spec.get("verify"):  # every rank: the re-hashing is shared out over the process group
        from aoe_megatron.cli import checkpoints

        results["verify"] = {str(p): checkpoints.main(["verify", str(p)]) for p in spec["verify"]}
    if spec.get("matmul_n") and rank0:
        from aoe_megatron.bench.measure import datasheet_peak_flops, gemm_peak_flops

        dtype = getattr(torch, spec.get("matmul_dtype", "bfloat16"))
        n = int(spec["matmul_n"])
        results["matmul"] = {"n": n, "dtype": str(dtype).replace("torch.", ""),
                             "flops": gemm_peak_flops("cuda" if cuda else "cpu", dtype, n=n)}
        flops, note = datasheet_peak_flops(results["device"], dtype)
        results["datasheet"] = {"flops": flops, "note": note}
    if rank0:
        _write(out, results)
    return 0


if __name__ == "__main__":  # the guard: megatron-core's checkpoint writer spawns a process
    sys.path.insert(0, str(REPO))
    from aoe_megatron.runtime.distributed import shutdown
    from aoe_megatron.runtime.exit import exit_now

    try:
        code = main(sys.argv[1])
    finally:
        shutdown()
    exit_now(code)
