"""Does the save after a stop signal fit the time the launcher gives it?

Slurm's time-limit warning (``#SBATCH --signal=TERM@120`` in ``run/slurm/pretrain.sbatch``)
reaches torchrun, which passes SIGTERM to every rank and SIGKILLs them ``--shutdown-timeout``
seconds later (the template's ``SHUTDOWN_TIMEOUT``; torchrun's default is 30 s), and Slurm kills
the job at the limit itself. In that window each rank finishes the step in flight, saves and
exits. A save cut off there is lost (its ``.partial`` folder is never read) and the run resumes
from the checkpoint before, every time the limit comes.

The run knows the window from ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` (torchrun's own variable, which it
reads when its flag is not given; the template exports it with the value it passes). Under
torchrun without it, torchrun's default is assumed and the warning says so; elsewhere (one
process, srun alone) nothing is compared. After every save, and when a run resumes (from the
save recorded in the checkpoints' state.json), a save that would not fit gets a WARNING naming
the seconds, the window and what to change.
"""

from __future__ import annotations

import math
import os
import time
from typing import Callable, Mapping, Optional

from aoe_megatron.checkpoint.layout import checkpoints, read_state
from aoe_megatron.runtime.host_memory import gib

WINDOW_VAR = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
TORCHRUN_DEFAULT = 30.0
"""torchrun's wait after SIGTERM when neither its flag nor ``WINDOW_VAR`` says otherwise."""
SAVE_MARGIN = 1.25
"""The measured save times this, for its spread: the same save varied by 12% (slowest over
fastest of 5) on a shared 2-core VM (bench/resume/save/README.md), and a time-limit stop may meet
other jobs writing to the same filesystem."""
EXIT_SECONDS = 10.0
"""After the save: the last barrier, process-group teardown, interpreter exit and torchrun seeing
the workers gone (an allowance, not a measurement: the exit path skips the interpreter's slow
teardown, ``runtime/exit.py``)."""


def window_from_env(environ: Optional[Mapping] = None) -> tuple:
    """(seconds, where they come from) of the stop window; (None, None) if unknown."""
    environ = os.environ if environ is None else environ
    value = environ.get(WINDOW_VAR, "").strip()
    if value:
        try:
            return float(value), WINDOW_VAR
        except ValueError:
            return None, None
    if environ.get("TORCHELASTIC_RUN_ID"):
        return TORCHRUN_DEFAULT, (f"torchrun's default, assumed: if its --shutdown-timeout "
                                  f"says otherwise, export {WINDOW_VAR} with the same value")
    return None, None


def needed_seconds(*, save_seconds: float, step_seconds: float = 0.0) -> float:
    """What a stop needs: the step in flight + ``SAVE_MARGIN`` x the save + ``EXIT_SECONDS``."""
    return step_seconds + SAVE_MARGIN * save_seconds + EXIT_SECONDS


def advice(*, save_seconds: float, window: Optional[float], step_seconds: float = 0.0,
           nbytes: Optional[int] = None, source: str = WINDOW_VAR,
           what: str = "the last save") -> Optional[str]:
    """The WARNING for a save of ``save_seconds`` that would not fit ``window``; None if it fits
    or the window is unknown."""
    needed = needed_seconds(save_seconds=save_seconds, step_seconds=step_seconds)
    if window is None or needed <= window:
        return None
    size = f" ({describe(nbytes, save_seconds)})" if nbytes else ""
    raise_to = int(math.ceil(needed / 10.0) * 10)
    return (f"WARNING: {what} took {save_seconds:.1f} s{size}: a stop at the time limit needs "
            f"about {needed:.0f} s (the step in flight {step_seconds:.1f} s + {SAVE_MARGIN} x the "
            f"save + {EXIT_SECONDS:.0f} s to exit), more than the {window:.0f} s stop window "
            f"({source}: how long torchrun waits after SIGTERM before it kills the ranks). A save "
            f"cut off there is lost and the run resumes from the checkpoint before. Raise "
            f"SHUTDOWN_TIMEOUT in run/slurm/pretrain.sbatch to at least {raise_to} s and the "
            f"#SBATCH --signal=TERM@ lead time with it (Slurm kills the job at the limit), or "
            f"save to a faster filesystem; a shorter --save-interval loses fewer steps when a "
            f"stop save is cut off")


def describe(nbytes: Optional[int], seconds: float) -> str:
    """"2.27 GB at 0.45 GB/s"."""
    if not nbytes:
        return ""
    return f"{nbytes / 1e9:.2f} GB at {nbytes / 1e9 / max(seconds, 1e-9):.2f} GB/s"


def last_recorded_save(ckpt_dir) -> Optional[dict]:
    """The newest checkpoint of ``ckpt_dir`` whose state.json records its save: {"checkpoint",
    "seconds", "bytes", "step_seconds"}; None if none does (or it holds none)."""
    for path in reversed(checkpoints(ckpt_dir) if ckpt_dir else []):
        try:
            state = read_state(path)
            save = state["save"]
            return {"checkpoint": path.name, "seconds": float(save["seconds"]),
                    "bytes": save.get("bytes"), "step_seconds": float(state.get("step_seconds", 0))}
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


class StopWindow:
    """The train loop's: times the steps between saves, reports each save (console, metrics) and
    warns when one would not fit the stop window. ``say`` prints on rank 0 only."""

    def __init__(self, *, start_step: int, say: Callable[[str], None], reporter=None,
                 resumed_from=None, environ: Optional[Mapping] = None):
        self.say, self.reporter = say, reporter
        self.window, self.source = window_from_env(environ)
        self._mark = (start_step, time.perf_counter())
        if resumed_from and self.window is not None and (last := last_recorded_save(resumed_from)):
            warning = advice(save_seconds=last["seconds"], window=self.window, source=self.source,
                             step_seconds=last["step_seconds"], nbytes=last["bytes"],
                             what=f"the last recorded save ({last['checkpoint']})")
            if warning:
                say(warning)

    def step_seconds(self, step: int, *, less: float = 0.0) -> float:
        """Mean seconds per step since the last save (or the start), evaluations included, the
        last ``less`` seconds left out (the save just made)."""
        done, since = step - self._mark[0], time.perf_counter() - self._mark[1] - less
        return max(since, 0.0) / done if done > 0 else 0.0

    def record(self, step: int) -> dict:
        """For the checkpoint's state.json: what a resumed run compares with its window."""
        return {"step_seconds": round(self.step_seconds(step), 3)}

    def saved(self, step: int, path, *, seconds: float, stats: dict) -> Optional[str]:
        """After a save of ``seconds`` (the whole save, as the loop measured it): the console
        line, the metrics line, and the warning if it would not fit (returned)."""
        step_seconds = self.step_seconds(step, less=seconds)
        nbytes, peak = (stats.get("save") or {}).get("bytes"), stats.get("host_peak_bytes")
        self.say(f"saved {path} ({seconds:.1f} s"
                 + (f", {describe(nbytes, seconds)}" if nbytes else "")
                 + (f"; host memory peak +{gib(peak)} on the busiest rank" if peak is not None
                    else "") + ")")
        if self.reporter is not None:
            self.reporter.save(step, seconds=seconds, nbytes=nbytes, window=self.window,
                               needed=needed_seconds(save_seconds=seconds,
                                                     step_seconds=step_seconds))
        warning = advice(save_seconds=seconds, window=self.window, source=self.source or "",
                         step_seconds=step_seconds, nbytes=nbytes)
        if warning:
            self.say(warning)
        self._mark = (step, time.perf_counter())
        return warning
