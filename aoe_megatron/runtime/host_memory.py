"""A process's peak host memory over a piece of work, for the checkpoint log lines, and its
resident size now, for the console.

Linux keeps the resident-set high-water mark (``VmHWM`` in ``/proc/self/status``); writing ``5``
to ``/proc/self/clear_refs`` resets it to the current resident size. So the peak of a save or a
load is measured exactly, allocations freed before the end included, without a sampling thread.
Where either file is missing or not writable the figure is None and nothing is reported.
"""

from __future__ import annotations

import re
from typing import Optional

_STATUS = "/proc/self/status"


def _status_kib(field: str) -> Optional[int]:
    try:
        with open(_STATUS, encoding="ascii") as f:
            match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def _reset_high_water_mark() -> bool:
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakHostMemory:
    """``with PeakHostMemory() as m: work()`` then ``m.added_bytes``: how far the resident size
    rose above its level at the start (None where the kernel does not say)."""

    def __enter__(self) -> "PeakHostMemory":
        self.added_bytes: Optional[int] = None
        self._start = _status_kib("VmRSS") if _reset_high_water_mark() else None
        return self

    def __exit__(self, *exc) -> None:
        peak = _status_kib("VmHWM")
        if self._start is not None and peak is not None:
            self.added_bytes = max(peak - self._start, 0) * 1024


def resident_bytes() -> Optional[int]:
    """This process's resident size now (``VmRSS``), or None where the kernel does not say."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def gib(nbytes: Optional[float]) -> str:
    return "unknown" if nbytes is None else f"{nbytes / 2**30:.2f} GiB"
