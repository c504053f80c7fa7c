"""Functions run in processes started by multiprocessing's ``spawn``: the ranks of a gloo world
on this machine (the distributed tests, the expert-parallel benchmark) or one fresh process (the
benchmark's memory phase). One implementation of the start, the deadline, the kill of what is
left, and a failure report that names every rank (the first rank to fail is often not rank 0,
whose own error is then only "connection closed by peer").

Training jobs are not started here: ``runtime/launch.py`` starts those, as torchrun does."""

from __future__ import annotations

import os
import time
import traceback
from typing import Callable


class SpawnFailed(RuntimeError):
    """A spawned process raised, exited without a result, or outlived the deadline; the message
    has each one's traceback or exit code."""


def _run(fn: Callable, rank: int, nprocs: int, port, args: tuple, queue) -> None:
    if port is not None:  # as torchrun sets them (DeepSpeed and init_megatron read them)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs))
    try:
        queue.put((rank, True, fn(rank, *args)))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))


def spawn(fn: Callable, nprocs: int, *args, timeout: float, rendezvous: bool = True,
          what: str = "spawned processes") -> list:
    """``fn(rank, *args)`` in ``nprocs`` spawned processes; their return values, by rank.

    ``fn`` must be importable (a module-level function) and its result picklable. With
    ``rendezvous`` each process gets MASTER_ADDR/MASTER_PORT (one free port), RANK, LOCAL_RANK
    and WORLD_SIZE; without, the environment as it is. Results are read as they come (a large one
    cannot block its process's exit). Raises :class:`SpawnFailed` if any process fails, exits
    without a result, or is still running ``timeout`` seconds after the start (it is killed), as
    its result may already be in: the processes' exits are part of what they do."""
    import torch.multiprocessing as mp

    from aoe_megatron.runtime.distributed import (  # deferred: torch-free for the spawned children
        free_port)

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port() if rendezvous else None
    procs = [ctx.Process(target=_run, args=(fn, r, nprocs, port, args, queue))
             for r in range(nprocs)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    results, failures = {}, {}

    def drain() -> None:
        while not queue.empty():
            rank, ok, value = queue.get()
            (results if ok else failures)[rank] = value

    # until every process has exited (a process that gave its result may take a while to exit:
    # its process group and checkpoint writers shut down), reading results as they come
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        drain()
        time.sleep(0.02)
    drain()
    for rank, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            p.join()
            done = " (its result in, not its exit)" if rank in results else ""
            failures.setdefault(rank, f"still running after {timeout:.0f} s{done}: killed")
        elif rank not in results and rank not in failures:
            failures[rank] = f"exited with code {p.exitcode} and no result"
        elif p.exitcode != 0 and rank not in failures:
            failures[rank] = f"exited with code {p.exitcode} after its result"
    if failures:
        report = "\n".join(f"--- rank {r} of {nprocs}:\n{text}" for r, text in sorted(failures.items()))
        raise SpawnFailed(f"{len(failures)} of {nprocs} {what} failed:\n{report}")
    return [results[r] for r in range(nprocs)]
