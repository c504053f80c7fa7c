"""One writer per checkpoint folder.

Two launches that save into one folder (a requeued job whose predecessor is still draining, a
command pasted twice) would interleave their saves and ``latest``. The run's rank 0 therefore
holds two things while it trains:

- an OS lock (POSIX ``lockf``) on ``FOLDER/.aoe-lock``. The kernel releases it when the process
  dies, however it dies, so a Slurm requeue after a crash is never blocked.
- a lease, ``FOLDER/.aoe-lease.json`` (host, pid, start, heartbeat), rewritten every
  ``HEARTBEAT_S``. This is for shared file systems, where OS locks do not reach across hosts. A
  lease whose holder stopped heart-beating more than ``LEASE_TIMEOUT_S`` ago is taken over, with
  a warning.

A launch that finds the folder held is refused (``FolderHeld``), naming the holder, before it
writes anything anywhere. ``python -m aoe_megatron.train.lock wait FOLDER`` waits for a
holder to go (the Slurm template runs it before a requeued launch).
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

LOCK_NAME, LEASE_NAME = ".aoe-lock", ".aoe-lease.json"
#: A holder that has not renewed its lease for this long is taken to be gone (seconds).
LEASE_TIMEOUT_S = float(os.environ.get("AOE_LEASE_TIMEOUT_S", 300))
HEARTBEAT_S = float(os.environ.get("AOE_LEASE_HEARTBEAT_S", 30))


class FolderHeld(RuntimeError):
    """Another launch holds the folder."""


def _describe(lease: dict) -> str:
    age = time.time() - float(lease.get("heartbeat", 0))
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(lease.get("started", 0)))
    run = f", run {lease['run_dir']}" if lease.get("run_dir") else ""
    return (f"host {lease.get('host')} pid {lease.get('pid')} (started {started}, last "
            f"heartbeat {age:.0f} s ago{run})")


def read_lease(folder) -> Optional[dict]:
    try:
        return json.loads((Path(folder) / LEASE_NAME).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _alive_here(lease: dict) -> bool:
    """Whether the lease's holder (a process of this host) is alive."""
    try:
        os.kill(int(lease["pid"]), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


def lease_is_live(lease: Optional[dict]) -> bool:
    """A holder that is alive here, or that renewed its lease within ``LEASE_TIMEOUT_S``."""
    if not lease:
        return False
    if lease.get("host") == socket.gethostname():
        return _alive_here(lease)
    return time.time() - float(lease.get("heartbeat", 0)) <= LEASE_TIMEOUT_S


class FolderLock:
    """The writer's hold on ``folder`` (``acquire`` it; ``release`` when done)."""

    def __init__(self, folder, *, run_dir=None, say: Callable[[str], None] = print):
        self.folder, self.run_dir, self.say = Path(folder), run_dir, say
        self._fd: Optional[int] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.lease: dict = {}

    def acquire(self) -> "FolderLock":
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno not in (errno.EACCES, errno.EAGAIN):
                raise
            lease = read_lease(self.folder)
            holder = _describe(lease) if lease else "a process whose lease is not written yet"
            raise FolderHeld(f"{self.folder} is held by another launch: {holder}") from None
        previous = read_lease(self.folder)
        # NOTE: holding the OS lock proves a holder on this host gone (the kernel released its
        # lock when it died); one on another host is judged by its heartbeat.
        if previous and previous.get("host") != socket.gethostname():
            if lease_is_live(previous):
                os.close(fd)
                raise FolderHeld(f"{self.folder} is held by another launch: {_describe(previous)}")
            self.say(f"warning: taking over the lease of {self.folder}: {_describe(previous)}, "
                     f"silent for more than {LEASE_TIMEOUT_S:.0f} s")
        self._fd = fd
        now = time.time()
        self.lease = {"host": socket.gethostname(), "pid": os.getpid(), "started": now,
                      "heartbeat": now, "run_dir": None if self.run_dir is None else str(self.run_dir)}
        self._write_lease()
        self._thread = threading.Thread(target=self._beat, name="aoe-lease", daemon=True)
        self._thread.start()
        return self

    def _write_lease(self) -> None:
        tmp = self.folder / f"{LEASE_NAME}.{os.getpid()}.partial"
        tmp.write_text(json.dumps(self.lease) + "\n")
        os.replace(tmp, self.folder / LEASE_NAME)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            self.lease["heartbeat"] = time.time()
            try:
                self._write_lease()
            except OSError as err:  # a file-system hiccup: the next beat tries again
                self.say(f"warning: could not renew the lease of {self.folder}: {err}")

    def release(self) -> None:
        if self._fd is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if (read_lease(self.folder) or {}).get("pid") == os.getpid():
            (self.folder / LEASE_NAME).unlink(missing_ok=True)
        os.close(self._fd)  # releases the OS lock
        self._fd = None


def wait_until_free(folder, timeout_s: float, *, say: Callable[[str], None] = print,
                    poll_s: float = 5.0) -> bool:
    """Wait (up to ``timeout_s``) until no live lease holds ``folder``; True when free."""
    deadline = time.monotonic() + timeout_s
    lease = read_lease(folder)
    if lease_is_live(lease):
        say(f"{folder} is held by {_describe(lease)}: waiting up to {timeout_s:.0f} s for it to end")
    while lease_is_live(lease := read_lease(folder)):
        if time.monotonic() >= deadline:
            say(f"{folder} is still held by {_describe(lease)}")
            return False
        time.sleep(min(poll_s, max(deadline - time.monotonic(), 0.05)))
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m aoe_megatron.train.lock", allow_abbrev=False,
        description="Wait until no live launch holds a checkpoint folder (the Slurm template runs "
                    "this before a requeued launch). Exit status 0: free; 1: still held.")
    ap.add_argument("command", choices=["wait"], help="wait: block until the folder is free")
    ap.add_argument("folder", help="the checkpoint (--save) folder")
    ap.add_argument("--timeout", type=float, default=LEASE_TIMEOUT_S + HEARTBEAT_S,
                    help="seconds to wait at most (default: the lease timeout plus one heartbeat, "
                         "%(default)s)")
    args = ap.parse_args(argv)
    free = wait_until_free(args.folder, args.timeout, say=lambda m: print(m, file=sys.stderr))
    return 0 if free else 1


if __name__ == "__main__":
    raise SystemExit(main())
