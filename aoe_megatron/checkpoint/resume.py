"""Checkpoints that survive preemption, corruption and a change of parallel layout.

A checkpoint is a directory ``step_00000100/``:
  model/          megatron-core distributed checkpoint of the GPTModel (experts as slices of
                  global tensors: loadable at any EP size)
  optimizer/      the same for each parameter's fp32 master weight and Adam moments
                  (``optim_state.py``): resumable at any world size, EP size and ZeRO-1/2 stage
  rng/rank{r}.pt  rank r's random generators (restored when the world size is unchanged)
  state.json      step, consumed samples, Adam step, the lr schedule and its position, layout,
                  config, the megatron-core release that saved it, extras
  manifest.json   every file's size and sha256 (``integrity.py``), written last
It is written as ``step_N.partial-*`` and renamed when complete on every rank; then ``latest``
(a one-line file) is replaced atomically. A crash at any point leaves the previous checkpoint and
``latest`` untouched. Resuming verifies the manifest and falls back to the newest older
checkpoint that verifies; ``last_verified`` names the newest checkpoint that passed a check, and
retention (``keep_last``) never deletes it or the one ``latest`` names.

The save itself is ``checkpoint/save.py``; this module resumes and loads. What a resume must
match (the model, the batch, the learning-rate schedule) is the trainer's to say
(``train/resume_checks.py``, through ``before_load``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from aoe_megatron.checkpoint import integrity, optim_state
from aoe_megatron.checkpoint.errors import CheckpointDamaged, CheckpointTooOld
from aoe_megatron.checkpoint.layout import (FORMAT, LATEST, VERIFIED, checkpoints, read_pointer,
                                            read_state, write_pointer)
from aoe_megatron.checkpoint.model import check_release
from aoe_megatron.checkpoint.save import max_over_ranks
from aoe_megatron.patches.mcore_dist_ckpt_results_queue import upstream_name
from aoe_megatron.runtime.host_memory import PeakHostMemory


def start_writer() -> None:
    """Start megatron-core's checkpoint-writer helper now, deaf to the stop signals.

    NOTE: megatron-core's writer starts a helper process (a multiprocessing Manager holding the
    results queue, ``filesystem_async.get_write_results_queue``; ``_get_write_results_queue``
    in 0.16.1) at the first save and keeps it
    for the life of the run. Slurm's time-limit warning goes to every process of the job step and
    torchrun signals each worker's process group, so that helper would die of the very SIGTERM
    that asks the run to save, and the save would fail (BrokenPipe). Ignored signals are
    inherited by a new process (handlers are not), so it is started here with them ignored.
    Call it once, in the main thread, before training.
    """
    import signal

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    stop_signals = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in stop_signals}
    try:
        getattr(filesystem_async, upstream_name())()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _candidates(ckpt_dir, log: Callable) -> list:
    """Checkpoints to try, best first: the one ``latest`` names, then older ones, newest first."""
    complete = checkpoints(ckpt_dir)
    target = read_pointer(ckpt_dir, LATEST)
    if target is None:
        if complete:
            log(f"{ckpt_dir} has checkpoints but no '{LATEST}' file: trying the newest first")
        return complete[::-1]
    named = Path(ckpt_dir) / target
    older = [p for p in complete if p.name < target][::-1]
    return [named, *older]


def _describe_changes(saved: dict, now: dict) -> list:
    names = {"world_size": "world size", "expert_parallel_size": "EP", "zero_stage": "ZeRO stage"}
    return [f"{label} {saved.get(key)} -> {now.get(key)}" for key, label in names.items()
            if saved.get(key) != now.get(key)]


def resume(ckpt_dir, *, engine, model, scheduler, layout: dict, seed: int,
           log: Callable = print, before_load: Optional[Callable] = None,
           mark_verified: bool = True) -> Optional[dict]:
    """Restore the newest checkpoint of ``ckpt_dir`` that verifies (None: there is none yet).

    A checkpoint that fails verification is reported with the file at fault and the next older
    one is tried; if checkpoints exist but none verifies, this raises (CheckpointDamaged) rather
    than start over. ``before_load(state)`` (``state["path"]`` names the checkpoint) runs before
    anything loads: it may refuse by raising, and what it returns, if anything, is said once the
    checkpoint is loaded. ``mark_verified``: record the checkpoint as ``last_verified`` in
    ``ckpt_dir`` (retention's fallback), only where this run also saves (a --load folder of
    another run is not written).
    """
    rank = dist.get_rank()
    say = log if rank == 0 else (lambda *_: None)
    tried = []
    for path in _candidates(ckpt_dir, say):
        stats = {}
        problems = (integrity.verify(path, trust_stamps=True, record=mark_verified,
                                     stats=stats) if path.is_dir()
                    else [f"{path} does not exist"])
        if problems and (path / "optim_rank0.pt").is_file():  # format 1: no manifest to check
            problems = []
        if problems:
            say(f"checkpoint {path} failed verification: {'; '.join(problems[:5])}"
                + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))
            tried.append(path.name)
            continue
        if stats.get("files"):
            unchanged = stats["files"] - stats["hashed"]
            say(f"verified {path}: {stats['files']} files, {stats['hashed']} hashed "
                f"({stats['bytes_hashed'] / 1e9:.2f} GB) in {stats['seconds']:.2f} s"
                + (f"; {unchanged} unchanged since last verified (size, mtime, ctime)"
                   if unchanged else ""))
        if tried:
            say(f"falling back to {path} (newest checkpoint that verifies; skipped "
                f"{', '.join(tried)})")
        state = read_state(path)
        if rank == 0 and mark_verified and state.get("format", 1) >= FORMAT:
            write_pointer(ckpt_dir, VERIFIED, path.name)
        state["path"] = str(path)
        note = before_load(state) if before_load is not None else None
        load_checkpoint(path, engine=engine, model=model, scheduler=scheduler, layout=layout,
                        seed=seed, state=state, log=say)
        if note:
            say(note)
        return state
    if tried:
        raise CheckpointDamaged(f"no checkpoint in {ckpt_dir} verifies (tried {', '.join(tried)}); "
                                f"nothing was loaded. Restore the files, or move the directory "
                                f"away to start over")
    return None


def load_checkpoint(path, *, engine, model, scheduler, layout: dict, seed: int = 0,
                    state: Optional[dict] = None, log: Callable = print) -> dict:
    """Restore model, optimizer, schedule and RNG from ``path`` at this run's ``layout``."""
    from megatron.core import dist_checkpointing

    path = Path(path)
    state = state or read_state(path)
    if state.get("format", 1) < FORMAT:
        raise CheckpointTooOld(f"{path} was written by an older aoe-megatron (per-rank optimizer "
                               f"files, no manifest): start from its weights with --load-weights "
                               f"{path}")
    check_release(path)
    rank = dist.get_rank()
    # AdamW's own state (made lazily at a run's first step) is created before the measurement:
    # the peak is what loading adds, not the memory every run holds for its optimizer anyway.
    optim_state.prepare_state(engine)
    with PeakHostMemory() as peak, optim_state.gathered(engine, model):  # weights follow the masters
        loaded = dist_checkpointing.load(optim_state.sharded_optimizer_state(model, engine, empty=True),
                                         str(path / "optimizer"))
        optim_state.restore_optimizer_state(model, engine, loaded, step=state["adam_step"])
        del loaded
    state["host_peak_bytes"] = max_over_ranks(peak.added_bytes)
    optim_state.weights_from_masters(engine)
    optim_state.restore_schedule(scheduler, state["scheduler_last_epoch"])
    changes = _describe_changes(state["layout"], layout)
    rng_file = path / "rng" / f"rank{rank}.pt"
    if state["layout"].get("world_size") == layout["world_size"] and rng_file.is_file():
        optim_state.set_rng_state(torch.load(rng_file, weights_only=True))
    else:
        optim_state.reseed(seed, state["step"], rank)
    if changes:
        log(f"resuming {path.name} at another layout: {', '.join(changes)}; model weights and "
            f"Adam state resharded"
            + ("; random generators re-seeded from (seed, step, rank)"
               if state["layout"].get("world_size") != layout["world_size"] else ""))
    return state
