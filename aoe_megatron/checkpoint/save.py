"""Writing a checkpoint (its layout and guarantees: ``checkpoint/resume.py``), how long it took,
and keeping the folder to its ``--keep-last`` newest.

Every save records in its ``state.json`` what it wrote and how long that took, under ``"save"``:
``seconds`` from the start of the save until every file was written and hashed (all that is left
then is writing state.json and the manifest, and the renames), and ``bytes``, the checkpoint's
files. The train loop adds the whole save's time (the rename and ``--keep-last`` included) to
the console and metrics.jsonl, and compares it with the stop window (``train/stop_window.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from aoe_megatron.checkpoint import integrity, optim_state
from aoe_megatron.checkpoint.layout import (FORMAT, LATEST, STATE, VERIFIED, checkpoints,
                                            read_pointer, step_name, write_pointer)
from aoe_megatron.runtime.distributed import reduce_across_ranks
from aoe_megatron.runtime.host_memory import PeakHostMemory
from aoe_megatron.runtime.versions import installed_mcore


def save_checkpoint(ckpt_dir, *, step: int, engine, model, scheduler, consumed_samples: int,
                    layout: dict, config: dict, extra: Optional[dict] = None,
                    keep_last: int = 0, stats: Optional[dict] = None) -> Path:
    """Write a checkpoint collectively (every rank calls this); returns its directory.
    ``stats``, if given, receives ``host_peak_bytes``: the most any rank's host memory rose while
    writing the model and optimizer state (None where it cannot be measured), and ``save``:
    state.json's record of this save (``seconds``, ``bytes``)."""
    from megatron.core import dist_checkpointing

    began = time.perf_counter()
    rank = dist.get_rank()
    root = Path(ckpt_dir)
    final = root / step_name(step)
    # Every rank uses rank 0's temporary name.
    tmp_name = [f"{step_name(step)}.partial-{socket.gethostname()}-{os.getpid()}" if rank == 0 else None]
    dist.broadcast_object_list(tmp_name, src=0)
    tmp = root / tmp_name[0]
    if rank == 0:
        for sub in ("model", "optimizer", "rng"):
            (tmp / sub).mkdir(parents=True)
    dist.barrier()
    try:
        with PeakHostMemory() as peak, optim_state.gathered(engine, model):
            dist_checkpointing.save(model.sharded_state_dict(), str(tmp / "model"))
            dist_checkpointing.save(optim_state.sharded_optimizer_state(model, engine),
                                    str(tmp / "optimizer"))
        if stats is not None:
            stats["host_peak_bytes"] = max_over_ranks(peak.added_bytes)
        torch.save(optim_state.rng_state(), tmp / "rng" / f"rank{rank}.pt")
        dist.barrier()
        # The data files were hashed as they were written (patches/
        # mcore_dist_ckpt_write_digests.py): only the small ones are read here.
        files = integrity.hash_files(tmp)
        save = {"seconds": round(time.perf_counter() - began, 3),
                "bytes": sum(e["size"] for e in files.values())}
        written = None
        if rank == 0:
            state = {"format": FORMAT, "step": step, "consumed_samples": consumed_samples,
                     "adam_step": optim_state.adam_step(engine),
                     "scheduler_last_epoch": scheduler.last_epoch, "layout": layout,
                     "config": config, "megatron_core": installed_mcore(), "save": save,
                     **(extra or {})}
            if (in_force := optim_state.schedule_in_force(scheduler)) is not None:
                state["schedule"] = in_force.record()  # what a resume compares its own with
            written = {STATE: (json.dumps(state, indent=2, sort_keys=True) + "\n").encode()}
        integrity.write_manifest(tmp, files=files, written=written)
        if stats is not None:
            stats["save"] = save
    except BaseException:
        if rank == 0:  # best effort: the half-written directory is never read, but takes space
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    dist.barrier()
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        write_pointer(root, LATEST, final.name)
        if keep_last:
            apply_retention(root, keep_last)
    dist.barrier()
    return final


def max_over_ranks(nbytes: Optional[int]) -> Optional[int]:
    """The largest of every rank's figure (collective); None if any rank has none."""
    most = int(reduce_across_ranks(torch.tensor(-1 if nbytes is None else nbytes), op="max").item())
    least = int(reduce_across_ranks(torch.tensor(-1 if nbytes is None else 0), op="max").item())
    return None if least < 0 else most


def apply_retention(ckpt_dir, keep_last: int, log: Callable = print) -> list:
    """Delete all but the ``keep_last`` newest checkpoints, never the one ``latest`` names nor
    ``last_verified``; also leftovers of interrupted saves. Returns what was deleted."""
    root = Path(ckpt_dir)
    protect = {read_pointer(root, LATEST), read_pointer(root, VERIFIED)}
    doomed = [p for p in checkpoints(root)[:-keep_last] if p.name not in protect]
    doomed += [p for p in root.glob("step_*.partial-*") if p.is_dir()]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    if doomed:
        log(f"--keep-last {keep_last}: deleted {', '.join(p.name for p in doomed)}")
    return doomed
