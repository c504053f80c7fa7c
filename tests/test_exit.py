"""runtime.exit.exit_now: a command's process ends without the interpreter's teardown, but after
everything a normal exit does that is seen outside the process."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_exit_now_joins_threads_runs_atexit_and_flushes(tmp_path):
    script = textwrap.dedent(f"""
        import atexit, pathlib, sys, threading, time
        from aoe_megatron.runtime.exit import exit_now

        out = pathlib.Path({str(tmp_path)!r})
        def late():
            time.sleep(0.5)
            (out / "thread").write_text("done")
        threading.Thread(target=late).start()
        atexit.register(lambda: (out / "atexit").write_text("ran"))
        sys.stdout.write("no newline, still buffered")
        sys.stderr.write("to stderr")
        exit_now(3)
        (out / "after").write_text("never")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "no newline, still buffered" and proc.stderr == "to stderr"
    assert (tmp_path / "thread").read_text() == "done"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert not (tmp_path / "after").exists()


def test_exit_now_treats_none_and_messages_as_sys_exit_does():
    for arg, code, err in (("None", 0, ""), ("'failed: reason'", 1, "failed: reason\n")):
        proc = subprocess.run([sys.executable, "-c", "from aoe_megatron.runtime.exit import "
                               f"exit_now; exit_now({arg})"], capture_output=True, text=True,
                              timeout=60)
        assert (proc.returncode, proc.stderr) == (code, err)
