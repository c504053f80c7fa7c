"""Checkpoints across the supported megatron-core releases (issue #33): one saved under 0.16.1
resumes under 0.19.2 with exactly the losses 0.16.1 gets; one saved under 0.19.2 is refused by
0.16.1 before anything loads, naming the release that reads it. Needs both CI legs'
virtualenvs: the second leg has them (the first leg made .venv); elsewhere these skip."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from aoe_megatron.runtime import launch
from aoe_megatron.runtime.versions import installed_mcore

ROOT = Path(__file__).resolve().parents[1]
VENVS = {"0.16.1": ROOT / ".venv" / "bin" / "python", "0.19.2": ROOT / ".venv-mcore019" / "bin" / "python"}
TRAIN = ["--preset", "tiny", "--mock-data", "--eval-interval", "0", "--log-interval", "1"]
RESUME = ["--train-iters", "4", "--override-opt_param-scheduler"]

pytestmark = [pytest.mark.legs, pytest.mark.slow]


@pytest.fixture
def python():
    """release -> its interpreter (this process's for the installed release)."""
    pythons = {**VENVS, installed_mcore(): Path(sys.executable)}
    missing = [str(p.parent.parent.name) for p in pythons.values() if not p.exists()]
    if missing:
        pytest.skip(f"the other leg's virtualenv ({', '.join(missing)}) is not here")
    return {release: str(p) for release, p in pythons.items()}


def _run(python, *args, tmp_path: Path, name: str):
    return launch.run([*TRAIN, *args, "--run-dir", tmp_path / f"run-{name}"], cwd=tmp_path,
                      python=python, summary=tmp_path / f"{name}.json", timeout=600)


def _losses(python, *args, tmp_path: Path, name: str) -> dict:
    done = _run(python, *args, tmp_path=tmp_path, name=name)
    assert done.returncode == 0, done.output[-4000:]
    return done.summary()["losses"]


def test_a_0161_checkpoint_resumes_under_0192_with_its_losses(python, tmp_path):
    _losses(python["0.16.1"], "--train-iters", "2", "--save", tmp_path / "ck", tmp_path=tmp_path,
            name="saved")
    load = [*RESUME, "--load", tmp_path / "ck"]
    old = _losses(python["0.16.1"], *load, "--save", tmp_path / "ck-old", tmp_path=tmp_path, name="old")
    new = _losses(python["0.19.2"], *load, "--save", tmp_path / "ck-new", tmp_path=tmp_path, name="new")
    assert sorted(new) == [3, 4]
    assert new == pytest.approx(old, rel=1e-6), (new, old)


def test_a_0192_checkpoint_is_refused_by_0161_naming_the_release(python, tmp_path):
    _losses(python["0.19.2"], "--train-iters", "2", "--save", tmp_path / "ck", tmp_path=tmp_path,
            name="saved")
    done = _run(python["0.16.1"], *RESUME, "--load", tmp_path / "ck", "--save", tmp_path / "ck-old",
                tmp_path=tmp_path, name="old")
    assert done.returncode != 0
    assert (f"{tmp_path / 'ck' / 'step_00000002'} was saved under megatron-core 0.19.2, whose "
            f"checkpoints megatron-core 0.16.1 cannot read") in done.output, done.output[-4000:]
    assert "Traceback" not in done.output, done.output[-4000:]
    assert not (tmp_path / "ck-old" / "latest").exists()
