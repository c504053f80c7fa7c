"""What the stop signals mean to a training process, at every moment of it.

- SIGINT (Ctrl-C) ends the process, wherever it is.
- SIGTERM and SIGUSR1 end it too until the first training step starts (nothing is worth
  saving yet: a dataset index being built, a rendezvous waiting for a peer, a checkpoint being
  loaded). From then on they ask the run to save and stop after the current step (Slurm's
  warning before the time limit, preemption), which the ranks agree on in the step's collective
  (``train/step.py``); a second SIGTERM (Slurm's at the limit itself) changes nothing.

Python runs a signal handler only when the main thread is back in the interpreter, and exits
only after its non-daemon threads end. A process stuck in C++ (a collective, a store wait) or
whose main thread waits on a worker thread (megatron-core builds datasets in a thread pool)
would never end. So the handler's exception is backed by a watchdog thread that sees each
signal through ``signal.set_wakeup_fd`` even while the main thread is stuck, and ends the
process with ``os._exit(128 + signal)`` when it has not ended ``GRACE_S`` seconds later.

NOTE: a forked child inherits the wakeup fd: it would report the child's signals to the
parent's watchdog (a worker pool terminated with SIGTERM would end the trainer), so
``os.register_at_fork`` drops it in the child. The child keeps the handlers, as before this
module: megatron's checkpoint writers, forked during a save, outlive Slurm's warning SIGTERM.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Optional

#: Seconds the main thread has to unwind (print, release the checkpoint folder) after an
#: ending signal before the watchdog ends the process (AOE_STOP_GRACE_S overrides it).
GRACE_S = float(os.environ.get("AOE_STOP_GRACE_S", "5"))
ENDING_ALWAYS = (signal.SIGINT,)
STOP_REQUESTS = (signal.SIGTERM, signal.SIGUSR1)
DEFAULTS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL,
            signal.SIGUSR1: signal.SIG_DFL}


class Interrupted(BaseException):
    """An ending signal arrived (BaseException, like KeyboardInterrupt: nothing catches it by
    accident); ``code`` is the exit status a shell gives such a death, 128 + the signal."""

    def __init__(self, signum: int):
        self.signum = signum
        self.code = 128 + signum
        super().__init__(f"{signal.Signals(signum).name}")


class StopSignals:
    """The process's stop signals, in force inside ``with`` (one per process:
    ``stop_signals()``). ``raised``: a stop was requested during training; ``training``: the
    first step has started."""

    def __init__(self, grace_s: float = GRACE_S):
        self.raised = self.training = self.active = False
        self.grace_s = grace_s
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._previous: dict = {}
        self._previous_fd = -1
        threading.Thread(target=self._watch, name="aoe-stop-signals", daemon=True).start()
        os.register_at_fork(after_in_child=self._forget_in_child)

    def __enter__(self) -> "StopSignals":
        self.raised = self.training = False
        self._previous = {sig: signal.signal(sig, self._handle) for sig in DEFAULTS}
        self._previous_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        self.active = True
        return self

    def __exit__(self, *exc) -> None:
        self.active = False
        signal.set_wakeup_fd(self._previous_fd)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else DEFAULTS[sig])

    def ends_now(self, signum: int) -> bool:
        return signum in ENDING_ALWAYS or not self.training

    def _handle(self, signum, frame):
        if self.ends_now(signum):
            raise Interrupted(signum)
        self.raised = True

    def _watch(self) -> None:
        while True:
            data = os.read(self._read_fd, 64)
            ending = [b for b in data if b in DEFAULTS and self.active and self.ends_now(b)]
            if ending:
                time.sleep(self.grace_s)
                name = signal.Signals(ending[0]).name
                print(f"{name}: the process did not end within {self.grace_s:g} s (stuck in a "
                      f"collective, a worker thread or C++ code); ending it now", file=sys.stderr,
                      flush=True)
                os._exit(128 + ending[0])

    def _forget_in_child(self) -> None:
        """After a fork, in the child: no wakeup fd into the parent's pipe (the child's signals
        are its own). The handlers stay as inherited: a checkpoint writer forked during training
        must outlive the SIGTERM Slurm sends every process of the step, as the parent does."""
        self.active = False
        try:
            old = signal.set_wakeup_fd(-1)
            if old != self._write_fd:
                signal.set_wakeup_fd(old)
        except ValueError:  # not the main thread of the child: leave it
            pass


_process: Optional[StopSignals] = None


def stop_signals() -> StopSignals:
    """The process's ``StopSignals`` (created on first use, from the main thread)."""
    global _process  # NOTE: signal dispositions are process-wide; so is their one owner
    if _process is None:
        _process = StopSignals()
    return _process
