"""Ending a command's process without the interpreter's teardown.

With torch, megatron-core and DeepSpeed loaded, CPython's finalization (module teardown, the C++
libraries' static destructors) takes about a second after the work is done, in every process of
every launch. ``exit_now`` first does what a normal exit does that is seen outside the process:
non-daemon threads are joined, atexit handlers run (logging, multiprocessing's children and
managers, anything a library registered), stdout and stderr are flushed; then ``os._exit``. Files
and writers must be closed by then, as the commands do (``with`` blocks, ``Reporter.close``).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading


def exit_now(code) -> None:
    """``sys.exit(code)`` less the interpreter's teardown (see the module's docstring)."""
    code = 0 if code is None else code
    if not isinstance(code, int):  # sys.exit("message") prints it and exits 1
        print(code, file=sys.stderr)
        code = 1
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # noqa: SLF001  (CPython's own exit path runs these too)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more to write
            pass
    os._exit(code)
