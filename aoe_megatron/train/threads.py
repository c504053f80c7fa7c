"""How OpenMP's threads wait, in a training process on the CPU.

torch's OpenMP threads wait for each other by spinning (GNU OpenMP's default, "active"): while any
other thread needs a core (the Python thread feeding the step, gloo, DeepSpeed, another job on the
machine) the whole team stalls. Measured on 2 cores with ``make smoke`` (tiny, 30 steps, tokens/s
of the logged intervals after the first, alternating; docs/training.md):

| OpenMP                   | idle machine | beside one busy process |
|--------------------------|-------------:|------------------------:|
| 2 threads, active wait   | about 2,450  | 87 (81 to 1,713)         |
| 2 threads, passive wait  | about 2,250  | about 1,520              |
| 1 thread                 | about 1,800  | about 1,720              |

So where the user has not set ``OMP_WAIT_POLICY``, a training process sets it to ``PASSIVE``
(torch's thread count unchanged): 8% below spinning on an idle machine, never the collapse beside
another job. GNU OpenMP reads the variable once, as torch loads: ``aoe-train``'s entry point
(``cli/train.py``) calls :func:`prefer_passive_wait` before anything imports torch.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

VAR = "OMP_WAIT_POLICY"
_SAID: list = []


def prefer_passive_wait(environ=os.environ) -> Optional[str]:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` unless the user set it or torch has loaded already (then
    too late: nothing changes); returns the line that says so, or None."""
    if VAR in environ or "torch" in sys.modules:
        return None
    environ[VAR] = "PASSIVE"
    _SAID[:] = [f"{VAR} is not set: OpenMP's threads wait passively (PASSIVE), so another process "
                f"on the machine cannot stall a step (set {VAR} to choose)"]
    return _SAID[0]


def said() -> Optional[str]:
    """The line :func:`prefer_passive_wait` returned in this process, if it set the policy."""
    return _SAID[0] if _SAID else None
