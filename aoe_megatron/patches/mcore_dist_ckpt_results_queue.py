"""Patch for ``megatron/core/dist_checkpointing/strategies/filesystem_async.py`` (0.16.1, 0.19.2),
every machine (Linux).

What: the function that makes the checkpoint writer's results queue (``_get_write_results_queue()``
in 0.16.1, ``get_write_results_queue(mp_mode="spawn")`` in 0.19.2: ``UPSTREAM_NAME``) starts its multiprocessing Manager (the process that holds the
checkpoint writer's results queue) with an initializer that asks the kernel to SIGKILL it when
the rank that started it dies (``prctl(PR_SET_PDEATHSIG)``).
Why: megatron starts that Manager with the spawn context and never stops it. A rank that is
SIGKILLed (the OOM killer, a node failure, ``scancel -s KILL``) therefore leaves it orphaned,
together with the resource tracker that only exits when the Manager does: about 280 MB per rank
under plain torchrun, piling up over requeues. Forked children already die with their rank
(``runtime.distributed._forked_children_die_with_their_parent``); a spawned process runs no fork
hooks, so this one needs its own.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import signal
import sys
from multiprocessing.managers import SyncManager

from ._patching import module, replace
from aoe_megatron.runtime.versions import mcore_at_least

TARGET = "megatron.core.dist_checkpointing.strategies.filesystem_async"
#: The supported megatron-core releases this patch applies to.
VERSIONS = ("0.16.1", "0.19.2")
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
#: The Managers started here (the queue's proxy refers to its Manager too; this makes it plain).
MANAGERS: list = []


def die_with_parent(parent_pid: int) -> None:
    """In the Manager's process: SIGKILL when the parent (the rank's thread that started it) dies."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def upstream_name() -> str:
    """The name of the function this patch replaces, in the installed megatron-core."""
    return "get_write_results_queue" if mcore_at_least("0.17") else "_get_write_results_queue"


def _get_write_results_queue(mp_mode: str = "spawn"):
    fs_async = module(TARGET)
    if fs_async._results_queue is None:
        manager = SyncManager(ctx=mp.get_context(mp_mode))
        manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
        MANAGERS.append(manager)
        fs_async._results_queue = manager.Queue()
    return fs_async._results_queue


def apply() -> bool:
    fs_async = module(TARGET)
    if not hasattr(fs_async, upstream_name()):
        raise RuntimeError(f"{TARGET} has no {upstream_name()}: review "
                           f"aoe_megatron/patches/mcore_dist_ckpt_results_queue.py against it")
    replace(fs_async, upstream_name(), _get_write_results_queue)
    return True
