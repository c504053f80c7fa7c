"""CPU threads of a single-process run on the CPU.

torchrun gives each of several processes one OpenMP thread. A single process on the CPU keeps
torch's default, one thread per physical core, and OpenMP's threads wait for each other by
spinning: whenever any other thread needs a core (the Python thread feeding the step, gloo,
DeepSpeed, another job) the whole team stalls. On 2 cores beside another 2-thread training job,
``make smoke`` ran at a median of 87 tokens/s (81 to 1,713) with torch's default of 2 threads and
1,631 tokens/s (1,487 to 1,758) with 1 (docs/training.md has the measurement). So where the user
has not set OMP_NUM_THREADS, a single CPU process leaves one core free: ``max(1, default - 1)``
threads.
"""

from __future__ import annotations

import os
from typing import Optional

VAR = "OMP_NUM_THREADS"


def cpu_threads(default: int) -> int:
    """The threads of a single CPU process when the user set none: one core left free."""
    return max(1, default - 1)


def choose_cpu_threads(*, world_size: int, cuda: bool) -> Optional[str]:
    """For a single process on the CPU whose environment sets no OMP_NUM_THREADS: set it (for
    any child process) and torch's intra-op threads to ``cpu_threads``; returns the line that
    says so, or None where nothing was changed (a user's setting, several processes, CUDA)."""
    import torch

    if VAR in os.environ or world_size != 1 or cuda:
        return None
    default = torch.get_num_threads()
    chosen = cpu_threads(default)
    os.environ[VAR] = str(chosen)
    torch.set_num_threads(chosen)
    return (f"{VAR} is not set: this single CPU process uses {chosen} thread(s) of torch's "
            f"default {default}, leaving a core to the rest (set {VAR} to choose)")
