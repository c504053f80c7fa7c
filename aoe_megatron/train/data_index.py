"""``aoe-train ... --build-data-index-only --world-size N``: build the data index cache of a job's
exact settings in one process (a CPU node, before the job), so that the job's rank 0 builds
nothing while the other ranks wait under the collective timeout (``data/index_cache.py``)."""

from __future__ import annotations

import time
from pathlib import Path

from aoe_megatron.data import index_cache
from aoe_megatron.train.batches import build_run_datasets
from aoe_megatron.train.run import Run


def build_index_only(run: Run, say=print) -> Path:
    """Build (or find complete) the index files the run would read at ``run.world_size``
    processes; returns the cache folder. No process group is started."""
    cache = Path(index_cache.default_path(run.cfg))
    start = time.perf_counter()
    say(f"building the data index cache in {cache.resolve()} for {run.world_size} process(es), "
        f"{run.steps} steps of {run.cfg.global_batch_size} sequences of {run.model.seq_length} "
        f"tokens (seed {run.cfg.seed})")
    build_run_datasets(run, run.world_size, say=say)
    say(f"done in {time.perf_counter() - start:.1f} s: launch the job with the same settings "
        f"(and --data-cache-path {cache} where it was given here) at world size "
        f"{run.world_size}; every node must see this folder at that path")
    return cache
