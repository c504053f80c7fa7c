"""tools/check_disk.py: the Makefile's refusal before the second leg's multi-GB install."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _check(*args):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "check_disk.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=60)


def test_too_little_space_is_refused_once_per_file_system_naming_the_need(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()  # the same file system as a: one sentence, not two
    done = _check("--need-gib", 2**40, "--for", "the big install", tmp_path / "a", tmp_path / "b")
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: the big install needs about 1.09951e+12 GiB")
    assert str(tmp_path / "a") in lines[0]


def test_enough_space_passes_silently_and_a_missing_folder_is_a_usage_error(tmp_path):
    done = _check("--need-gib", 0, tmp_path)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    done = _check("--need-gib", 0, tmp_path / "missing")
    assert done.returncode == 2 and "not a folder" in done.stderr
