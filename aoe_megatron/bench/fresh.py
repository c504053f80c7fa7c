"""The memory phase on CPU, in a freshly spawned process.

The CPU peak probe (``measure.enable_cpu_peak_tracking``) needs every allocation of 64 KiB or more
to be mmapped: in the benchmark's own process, after the timings, glibc would serve the memory
phase from heap memory the timed steps left resident, and RSS would not move. A fresh process
whose first act is to set the probe up starts with no such memory.
"""

from __future__ import annotations

from aoe_megatron.bench import layer, measure, model
from aoe_megatron.runtime.compat import quiet_cpu_fallback_warnings
from aoe_megatron.runtime.distributed import init_megatron, shutdown
from aoe_megatron.runtime.spawn import spawn


def _phase(rank: int, job: dict) -> dict:
    """The memory phase in the spawned process (runtime.spawn sets its rendezvous, world 1)."""
    import torch

    if not measure.enable_cpu_peak_tracking():
        raise RuntimeError("peak memory on CPU needs Linux with glibc and a writable "
                           "/proc/self/clear_refs")
    quiet_cpu_fallback_warnings()
    torch.set_num_threads(job["threads"])
    kw = dict(quick=job["quick"], device="cpu", dtype=getattr(torch, job["dtype"]),
              use_te=False, log=lambda msg: print(f"[memory] {msg}", flush=True))
    try:
        init_megatron(expert_parallel_size=1)
        out = {}
        if job["layer"]:
            out["layer"] = layer.run(**kw, shapes=job["shapes"], arms=job["arms"], reps=1,
                                     phase="memory")
        if job["model"]:
            out["model"] = model.run(**kw, models=job["models"], archs=job["archs"], reps=1,
                                     phase="memory")
        return out
    finally:
        shutdown()


def memory_phase(*, quick: bool, dtype, shapes, layer: bool, model: bool, threads: int,
                 arms=None, models=None, archs=("moe", "aoe")) -> dict:
    """{"layer": ..., "model": ...} memory results, measured in a spawned process (the layer
    level's ``shapes`` and ``arms``, the model level's ``models`` and ``archs``, as layer.run and
    model.run take them)."""
    job = {"quick": quick, "dtype": str(dtype).removeprefix("torch."), "shapes": shapes,
           "arms": arms, "models": models, "archs": list(archs), "layer": layer, "model": model,
           "threads": threads}
    # no deadline of its own (a full benchmark's memory phase takes as long as it takes)
    (result,) = spawn(_phase, 1, job, timeout=float("inf"), what="memory-phase process")
    return result
