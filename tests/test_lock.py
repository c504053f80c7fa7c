"""One writer per checkpoint folder (issue #24): an OS lock released when its holder dies, a
lease for hosts the lock does not reach, a refused second launch that writes nothing."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aoe_megatron.runtime import launch
from aoe_megatron.train import lock
from aoe_megatron.train.loop import EXIT_FOLDER_HELD
from aoe_megatron.train.loop import main as train_main

ROOT = Path(__file__).resolve().parents[1]
HOLD = ("import sys, time\nfrom aoe_megatron.train.lock import FolderLock\n"
        "FolderLock(sys.argv[1]).acquire()\nprint('held', flush=True)\ntime.sleep(600)\n")


def _holder(folder: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _lease(folder: Path, *, host: str, age_s: float) -> None:
    now = time.time()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / lock.LEASE_NAME).write_text(json.dumps(
        {"host": host, "pid": 4242, "started": now - age_s, "heartbeat": now - age_s}))


def test_a_held_folder_is_refused_naming_the_holder_until_the_holder_dies(tmp_path):
    holder = _holder(tmp_path)
    try:
        with pytest.raises(lock.FolderHeld) as refused:
            lock.FolderLock(tmp_path).acquire()
        assert f"host {socket.gethostname()} pid {holder.pid}" in str(refused.value)
    finally:
        holder.send_signal(signal.SIGKILL)  # no chance to release: the kernel does it
        holder.wait()
    said = []
    mine = lock.FolderLock(tmp_path, say=said.append).acquire()
    try:
        assert lock.read_lease(tmp_path)["pid"] == os.getpid() and not said
    finally:
        mine.release()
    assert lock.read_lease(tmp_path) is None


def test_a_lease_from_another_host_counts_until_it_goes_stale(tmp_path, monkeypatch):
    monkeypatch.setattr(lock, "LEASE_TIMEOUT_S", 60.0)
    _lease(tmp_path, host="node-elsewhere", age_s=5)
    with pytest.raises(lock.FolderHeld, match="host node-elsewhere pid 4242"):
        lock.FolderLock(tmp_path).acquire()
    assert not lock.wait_until_free(tmp_path, 0.2, say=lambda _: None, poll_s=0.05)

    _lease(tmp_path, host="node-elsewhere", age_s=61)
    assert lock.wait_until_free(tmp_path, 0.2, say=lambda _: None)
    said = []
    taken = lock.FolderLock(tmp_path, say=said.append).acquire()
    try:
        assert said and said[0].startswith(f"warning: taking over the lease of {tmp_path}: host "
                                           f"node-elsewhere pid 4242")
        assert lock.read_lease(tmp_path)["host"] == socket.gethostname()
    finally:
        taken.release()


def test_the_lease_is_renewed_while_held(tmp_path, monkeypatch):
    monkeypatch.setattr(lock, "HEARTBEAT_S", 0.05)
    held = lock.FolderLock(tmp_path).acquire()
    try:
        first = lock.read_lease(tmp_path)["heartbeat"]
        time.sleep(0.3)
        assert lock.read_lease(tmp_path)["heartbeat"] > first
    finally:
        held.release()


@pytest.mark.slow
def test_a_second_launch_on_a_held_folder_writes_nothing_and_the_first_finishes(tmp_path, capsys):
    ck, run_dir = tmp_path / "ck", tmp_path / "run"
    args = ["--preset", "tiny", "--mock-data", "--train-iters", "4", "--micro-batch-size", "1",
            "--global-batch-size", "2", "--eval-interval", "0", "--save", str(ck), "--load",
            str(ck), "--run-dir", str(run_dir)]
    with open(tmp_path / "first.log", "w") as log:
        first = launch.start(args, nproc=1, cwd=ROOT, stdout=log)
        deadline = time.monotonic() + 120
        while not ((ck / lock.LEASE_NAME).is_file() and (run_dir / "config.json").is_file()):
            assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()
            time.sleep(0.1)
        planted = run_dir / "halted.json"  # the holder's run folder: the refused launch must
        planted.write_text("{}")             # neither clear it nor write its own record there
        assert train_main(args) == EXIT_FOLDER_HELD
        err = capsys.readouterr().err
        assert f"error: {ck} is held by another launch: host {socket.gethostname()}" in err, err
        assert "This launch wrote nothing" in err
        assert planted.read_text() == "{}"
        assert first.wait(timeout=300) == 0, (tmp_path / "first.log").read_text()[-3000:]
    assert (run_dir / "finished.json").is_file()
    assert (ck / "latest").read_text().strip() == "step_00000004"
    assert lock.read_lease(ck) is None  # released at the end
