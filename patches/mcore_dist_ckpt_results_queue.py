"""Patch for ``megatron/core/dist_checkpointing/strategies/filesystem_async.py`` (0.16.1), every
machine (Linux).

What: ``_get_write_results_queue`` starts its multiprocessing Manager (the process that holds the
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

TARGET = "megatron.core.dist_checkpointing.strategies.filesystem_async"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
#: The Managers started here (the queue's proxy refers to its Manager too; this makes it plain).
MANAGERS: list = []


def die_with_parent(parent_pid: int) -> None:
    """In the Manager's process: SIGKILL when the parent (the rank's thread that started it) dies."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _get_write_results_queue():
    fs_async = module(TARGET)
    if fs_async._results_queue is None:
        manager = SyncManager(ctx=mp.get_context("spawn"))
        manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
        MANAGERS.append(manager)
        fs_async._results_queue = manager.Queue()
    return fs_async._results_queue


def apply() -> bool:
    replace(module(TARGET), "_get_write_results_queue", _get_write_results_queue)
    return True
