"""Process-group set-up shared by the entry points and the tests (CPU: gloo, GPU: NCCL)."""

from __future__ import annotations

import ctypes
import functools
import os
import signal
import socket
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from aoe_megatron.patches import apply_patches
from aoe_megatron.runtime.compat import say_fallback_once


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BACKEND_VAR = "AOE_DIST_BACKEND"
"""Forces the backend: ``nccl`` or ``gloo`` (gloo takes CUDA tensors too; the GPU check falls back
to it when NCCL refuses its ranks). Unset: NCCL with CUDA, else gloo."""
HOST_PER_RANK_VAR = "AOE_NCCL_HOST_PER_RANK"
"""``1``: each rank gets its own ``NCCL_HOSTID`` (``default_backend``)."""


def default_backend() -> str:
    """NCCL with CUDA, else gloo, unless ``AOE_DIST_BACKEND`` says which.

    With NCCL and ``AOE_NCCL_HOST_PER_RANK=1``, this process's ``NCCL_HOSTID`` is set to
    ``<hostname>-rank<RANK>`` first. NOTE: NCCL refuses two ranks on one GPU of one host
    ("Duplicate GPU detected"); ranks it takes for different hosts talk over its network
    transport (sockets) instead, so several ranks can share one GPU: the GPU check's
    expert-parallel step on a one-GPU machine. RANK, not LOCAL_RANK, which
    ``local_device_index`` has already rewritten to the device index (0 for every rank there).
    """
    backend = os.environ.get(BACKEND_VAR) or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"{BACKEND_VAR}={backend!r}: expected nccl or gloo")
    if backend == "nccl" and os.environ.get(HOST_PER_RANK_VAR) == "1":
        os.environ["NCCL_HOSTID"] = f"{socket.gethostname()}-rank{os.environ.get('RANK', '0')}"
    return backend


def comm_device(group=None) -> torch.device:
    """The device whose tensors ``group``'s collectives take (default: the world group).

    This process's CUDA device when the group reduces CUDA tensors with NCCL, else the CPU (gloo).
    NOTE: a group started with plain ``nccl`` has no CPU backend: a collective on a CPU tensor
    raises "No backend type associated with device type cpu". Every tensor collective of the
    training loop takes its device from here, rather than registering gloo beside NCCL for every
    group (``cpu:gloo,cuda:nccl``): that would open a gloo connection mesh per megatron-core and
    DeepSpeed group and silently route any stray CPU tensor over TCP.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return torch.device("cpu")
    spec = str(dist.get_backend(group))
    if ":" in spec:  # per device type, e.g. "cpu:gloo,cuda:nccl"
        by_device = dict(part.split(":", 1) for part in spec.split(","))
    else:
        by_device = {"cuda" if spec == "nccl" else "cpu": spec}
    if by_device.get("cuda") == "nccl" or "cpu" not in by_device:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_across_ranks(tensor: torch.Tensor, *, op: str = "sum", group=None) -> torch.Tensor:
    """``tensor`` reduced over ``group``'s ranks ("sum", "max" or "mean"), as a new tensor on the
    group's communication device (``comm_device``); read it with ``.item()`` / ``.tolist()``.
    Without a process group it is ``tensor`` itself (one process)."""
    if op not in ("sum", "max", "mean"):
        raise ValueError(f"op must be 'sum', 'max' or 'mean', got {op!r}")
    if not (dist.is_available() and dist.is_initialized()):
        return tensor.detach().clone()
    out = tensor.detach().to(comm_device(group), copy=True)
    dist.all_reduce(out, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
    if op == "mean":
        out /= dist.get_world_size(group)
    return out


def broadcast_from(tensor, *, src: int, shape, dtype: torch.dtype, group=None) -> torch.Tensor:
    """Global rank ``src``'s ``tensor`` on every rank of ``group`` (the others pass None), as a
    tensor of ``shape`` and ``dtype`` on the group's communication device."""
    device = comm_device(group)
    if dist.get_rank() == src:
        out = tensor.detach().to(device=device, dtype=dtype)
    else:
        out = torch.empty(shape, dtype=dtype, device=device)
    if dist.get_world_size(group) > 1:
        dist.broadcast(out, src=src, group=group)
    return out


def local_device_index(rank: int = 0) -> int:
    """The CUDA device this process drives: ``LOCAL_RANK`` (else ``rank``) modulo the devices it
    sees, written back to ``LOCAL_RANK``.

    NOTE: launched by ``srun`` with one task per GPU (``--gpus-per-task=1``), each task sees one
    device (CUDA_VISIBLE_DEVICES) while its LOCAL_RANK (SLURM_LOCALID) counts the node's tasks:
    device 3 would be an invalid ordinal. DeepSpeed's engine picks its device from the
    environment's LOCAL_RANK itself, hence the write-back.
    """
    local = int(os.environ.get("LOCAL_RANK", rank))
    index = local % torch.cuda.device_count()
    os.environ["LOCAL_RANK"] = str(index)
    return index


DEFAULT_TIMEOUT_MINUTES = 10.0
"""Megatron-LM's ``--distributed-timeout-minutes`` default (torch's own is 30 minutes)."""


def init_megatron(
    *, rank: int = 0, world_size: int = 1, expert_parallel_size: int = 1, seed: int = 1234,
    backend: str | None = None, timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES,
) -> None:
    """Start torch.distributed (if needed) and megatron-core's parallel state; TP = PP = 1.

    A collective that waits longer than ``timeout_minutes`` for a peer raises instead of hanging
    (every group megatron-core creates gets it; ``bound_collective_waits`` gives it to groups
    created later). NOTE: on gloo a peer process that dies is noticed at once, as its sockets
    close ("Connection reset by peer"); its forked children die with it, or they would keep the
    sockets open (``_forked_children_die_with_their_parent``). The timeout bounds the wait for a
    peer that is alive but stuck (stopped, looping outside the collectives, blocked on a file
    system) or a host gone without closing its connections.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    apply_patches()
    say_fallback_once()
    _forked_children_die_with_their_parent()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        if torch.cuda.is_available():
            torch.cuda.set_device(local_device_index(rank))
        dist.init_process_group(backend or default_backend(), rank=rank, world_size=world_size,
                                timeout=timedelta(minutes=timeout_minutes))
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=expert_parallel_size,
        distributed_timeout_minutes=timeout_minutes,
        # NOTE: megatron-core's default also builds gloo groups for DP, DP-with-CP and expert-DP
        # (its distributed optimizer's CPU-side collectives): each connects every pair of its
        # ranks over TCP at start-up, on the address the hostname resolves to; where that is
        # 127.0.1.1 or a firewalled interface, a multi-node job hangs before step 1. Nothing of
        # ours (DeepSpeed's ZeRO, the checkpoint writer, the collectives of runtime/) uses them.
        create_gloo_process_groups=False,
    )
    bound_collective_waits(timeout_minutes)  # any group made without it (DeepSpeed's: later)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@functools.cache  # once per process: fork hooks cannot be unregistered
def _forked_children_die_with_their_parent() -> None:
    """Every child this process forks from a main thread gets SIGKILL when its parent dies.

    NOTE: a forked child inherits the rank's gloo sockets (megatron-core's checkpoint writer forks
    two children per save). If the rank is SIGKILLed, a child that outlives it keeps those sockets
    open, so the other ranks never see the rank die: they block until the collective timeout, and
    the child is orphaned for good. Forks from other threads are left alone: the parent-death
    signal follows the forking thread, not the process.
    """
    if not sys.platform.startswith("linux"):
        return
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    forked_by = [None]  # the parent's pid, set just before a fork from a main thread

    def before() -> None:
        main = threading.current_thread() is threading.main_thread()
        forked_by[0] = os.getpid() if main else None

    def after_in_child() -> None:
        if forked_by[0] is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != forked_by[0]:  # the parent died before prctl took effect
                os._exit(1)

    os.register_at_fork(before=before, after_in_child=after_in_child)


def bound_collective_waits(timeout_minutes: float) -> None:
    """Give every process group that exists now this timeout. Groups created without one keep
    torch's 30 minutes: DeepSpeed's copy of the world group (ZeRO's gradient reductions), created
    by ``deepspeed.initialize`` (megatron-core's expert-data-parallel gloo group was another,
    until ``init_megatron`` stopped asking for gloo groups).

    NOTE: ``_set_pg_timeout`` is private; megatron-core's ``update_pg_timeout`` calls it too, but
    only on the groups megatron-core made."""
    from torch.distributed import distributed_c10d as c10d

    for group in list(c10d._world.pg_map):
        if not c10d._rank_not_in_group(group):
            c10d._set_pg_timeout(timedelta(minutes=timeout_minutes), group)


def shutdown() -> None:
    """Tear down megatron-core's parallel state and the process group, where set up. Imports
    nothing: a process stopped while megatron-core was still loading (a SIGINT during the
    imports) has nothing to tear down, and loading it again from its half-loaded modules fails
    (then that error, not the signal's exit status, would end the process)."""
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    initialized = getattr(parallel_state, "model_parallel_is_initialized", None)
    if initialized is not None and initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
