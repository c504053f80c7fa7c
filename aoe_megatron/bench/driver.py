"""``aoe-bench``'s run: the levels asked for (layer, model, ep) in the order that keeps timings
clean, then the memory phase, merged into one results dict with what the reader needs to know
(``meta``). The command line (``cli/bench.py``) parses, checks and reports; this runs."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable, Optional

import torch

from aoe_megatron.bench import ep, fresh, layer, model, report
from aoe_megatron.runtime.distributed import init_megatron, shutdown


@dataclass(frozen=True)
class BenchRun:
    """One ``aoe-bench`` invocation, resolved (device, dtype and TE decided, names checked)."""

    command: str
    quick: bool
    device: str
    dtype_name: str
    use_te: bool
    only: tuple
    reps: int
    reps_explicit: bool
    model_reps: int
    shapes: Optional[list]
    arms: list
    models: Optional[list]
    """None: the device's default models (``model.default_models``)."""
    model_archs: list

    @property
    def dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.dtype_name]


def run(bench: BenchRun, *, log: Callable[[str], None]) -> dict:
    """Every level asked for; returns the results (``report.write`` takes them)."""
    start = time.perf_counter()
    log(f"{bench.command}: device {bench.device}, dtype {bench.dtype_name}, TE "
        f"{'on' if bench.use_te else 'off'}, {bench.reps} reps ({bench.model_reps} at the model "
        f"level), levels {','.join(bench.only)}")
    models = bench.models or model.default_models(quick=bench.quick, device=bench.device)
    skipped = ([] if bench.models or bench.quick
               else [n for n in model.MODELS if n not in models])
    if skipped and "model" in bench.only:
        log(f"[model] skipping {','.join(skipped)} on {bench.device} (GPU-only by default; "
            "--models runs it)")
    results: dict = {}
    kw = dict(quick=bench.quick, device=bench.device, dtype=bench.dtype, use_te=bench.use_te, log=log)
    layer_kw = dict(shapes=bench.shapes, arms=bench.arms, reps=bench.reps,
                    reps_explicit=bench.reps_explicit)
    model_kw = dict(models=models, archs=bench.model_archs)
    init_megatron(expert_parallel_size=1)
    try:
        # Timings first, with the allocator as it is; the CPU memory probe changes how glibc
        # serves allocations (every one >= 64 KiB mmapped), which would slow every step.
        timed_layer = layer.run(**kw, **layer_kw) if "layer" in bench.only else None
        timed_model = (model.run(**kw, **model_kw, reps=bench.model_reps)
                       if "model" in bench.only else None)
        if "ep" in bench.only:  # spawned processes: a fresh allocator each
            results["ep"] = ep.run(quick=bench.quick, device=bench.device, dtype=bench.dtype,
                                   use_te=bench.use_te, reps=bench.reps, log=log)
        if bench.device == "cpu":  # a fresh process: see aoe_megatron/bench/fresh.py
            log("memory phase: a fresh process with the CPU peak probe")
            mem = fresh.memory_phase(quick=bench.quick, dtype=bench.dtype, shapes=bench.shapes,
                                     arms=bench.arms, **model_kw, layer=timed_layer is not None,
                                     model=timed_model is not None, threads=torch.get_num_threads())
        else:
            mem = {"layer": layer.run(**kw, **layer_kw, phase="memory") if timed_layer else None,
                   "model": (model.run(**kw, **model_kw, reps=1, phase="memory")
                             if timed_model else None)}
        if timed_layer is not None:
            results["layer"] = layer.merge(timed_layer, mem["layer"])
        if timed_model is not None:
            results["model"] = model.merge(timed_model, mem["model"])
    finally:
        shutdown()
    results["meta"] = _meta(bench, models, skipped, results, wall_s=time.perf_counter() - start)
    return results


def _meta(bench: BenchRun, models: list, skipped: list, results: dict, *, wall_s: float) -> dict:
    meta = {"command": bench.command, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "wall_s": wall_s, "quick": bench.quick, "reps": bench.reps,
            "model_reps": bench.model_reps, "arms": bench.arms, "models": models,
            "model_archs": bench.model_archs, "device": bench.device, "dtype": bench.dtype_name,
            "use_te": bench.use_te, "machine": report.machine_info(bench.device), "notes": []}
    capped = {n: layer.reps_for(n, bench.reps, explicit=bench.reps_explicit)
              for n in results.get("layer", {})}
    capped = {n: r for n, r in capped.items() if r != bench.reps}
    if capped:
        meta["notes"].append("fewer timed reps at " + ", ".join(f"{n} ({r})" for n, r in capped.items())
                             + " to keep the default run short; --reps N sets every shape.")
    if skipped and "model" in results:
        meta["notes"].append(f"model level: {', '.join(skipped)} left out on {bench.device} "
                             "(GPU-only by default).")
    if bench.quick:
        meta["notes"].append("--quick: tiny shapes and few reps, to check the tool; the timings mean "
                             "little and CPU peak memory does not see allocations under 64 KiB.")
    return meta
