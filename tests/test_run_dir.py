"""One run per run directory (``train/run_dir.py``): a run that resumes no checkpoint moves an
earlier run's files aside, a resumed run appends, and a run without --run-dir gets a folder of its
own (``SAVE/run`` when it saves checkpoints). One process, --mock-data, two or three steps."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from aoe_megatron.runtime import launch
from aoe_megatron.train import run_dir as rd
from aoe_megatron.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
RUN = ["--preset", "tiny", "--set", "vocab_size=512", "--mock-data", "--global-batch-size", "2",
       "--micro-batch-size", "1", "--lr-warmup-iters", "1", "--log-interval", "1",
       "--eval-interval", "0"]


def _train(args, cwd=ROOT) -> launch.Finished:
    return launch.run([*RUN, *args], nproc=1, cwd=cwd, timeout=300)


def _steps(run_dir: Path, kind: str = "train") -> list:
    """The steps of metrics.jsonl's ``kind`` lines, in file order."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if r["kind"] == kind]


def test_default_run_dirs(tmp_path, monkeypatch):
    """--run-dir as given; else SAVE/run (--save or --ckpt-dir); else a new runs/<UTC time>-<preset>,
    with -2 where a launch of the same second took that name."""
    monkeypatch.chdir(tmp_path)
    run = dict(train_iters=1, mock_data=True)
    assert rd.resolve_run_dir(TrainConfig(preset="tiny", run_dir="r", save="s", **run)) == "r"
    assert rd.resolve_run_dir(TrainConfig(preset="tiny", save="s", load="l", **run)) == str(Path("s/run"))
    assert rd.resolve_run_dir(TrainConfig(preset="x/my.yaml", ckpt_dir="c", **run)) == str(Path("c/run"))
    monkeypatch.setattr(time, "gmtime", lambda *_: time.struct_time((2024, 1, 2, 3, 4, 5, 1, 2, 0)))
    made = [rd.resolve_run_dir(TrainConfig(preset=p, **run)) for p in ("tiny", "tiny", "x/my.yaml")]
    assert made == ["runs/20240102-030405-tiny", "runs/20240102-030405-tiny-2",
                    "runs/20240102-030405-my"]
    assert all(Path(m).is_dir() for m in made)


def test_a_new_run_moves_only_the_files_training_wrote(tmp_path):
    """From scratch: the run files (an earlier attempt's cleared halt record as halted.json) go to
    previous/<UTC time of the oldest>/; other files and folders stay. Resumed: nothing moves, and
    the cleared halt record is dropped."""
    from aoe_megatron.train.faults import clear_halt_record

    folder = tmp_path / "run"
    (folder / "ckpt").mkdir(parents=True)
    for name in ("metrics.jsonl", "config.json", "events.out.tfevents.1.host.7.0", "halted.json",
                 "preset.yaml", "study-run.json", "train.log"):
        (folder / name).write_text(name)
    clear_halt_record(folder)
    assert not (folder / "halted.json").exists()
    rd.open_run_dir(folder, resumed=True, say=pytest.fail)
    assert sorted(p.name for p in folder.iterdir()) == [
        "ckpt", "config.json", "events.out.tfevents.1.host.7.0", "metrics.jsonl", "preset.yaml",
        "study-run.json", "train.log"]

    (folder / "halted.json").write_text("halted.json")
    clear_halt_record(folder)
    os.utime(folder / "config.json", (0, 86400 + 3661))  # the oldest: the run's start
    said = []
    rd.open_run_dir(folder, resumed=False, say=said.append)
    moved = folder / "previous" / "19700102-010101"
    assert said == [f"{folder} held an earlier run: its files are now in {moved} (a run that "
                    f"resumes no checkpoint starts a record of its own)"]
    assert sorted(p.name for p in moved.iterdir()) == [
        "config.json", "events.out.tfevents.1.host.7.0", "halted.json", "metrics.jsonl"]
    assert sorted(p.name for p in folder.iterdir()) == [
        "ckpt", "preset.yaml", "previous", "study-run.json", "train.log"]
    rd.open_run_dir(folder, resumed=False, say=pytest.fail)  # nothing left to move


@pytest.mark.slow
def test_a_run_without_run_dir_gets_its_own_folder_and_a_new_run_moves_it_aside(
        tmp_path):
    """A launch without --run-dir or a checkpoint folder writes to a new runs/<UTC time>-tiny
    folder (two such launches in one second get two: the test above); a second launch from
    scratch into that folder moves the first run's files (metrics.jsonl, TensorBoard events,
    records) to previous/<time>/ and leaves the folder's other files (a study runner's) alone."""
    out = _train(["--train-iters", "2"], cwd=tmp_path)
    assert out.returncode == 0, out.output[-3000:]
    [first] = sorted((tmp_path / "runs").iterdir())
    assert re.fullmatch(r"\d{8}-\d{6}-tiny", first.name), first
    assert _steps(first) == [1, 2]
    assert json.loads((first / "config.json").read_text())["train"]["run_dir"] == f"runs/{first.name}"
    assert (first / "finished.json").is_file() and list(first.glob("events.out.tfevents.*"))
    assert f"run directory: {first}" in out.output

    (first / "train.log").write_text("the study runner's log\n")
    out = _train(["--train-iters", "3", "--run-dir", first])
    assert out.returncode == 0, out.output[-3000:]
    [moved] = list((first / "previous").iterdir())
    assert f"{first} held an earlier run: its files are now in {moved}" in out.output
    assert _steps(first) == [1, 2, 3] and _steps(moved) == [1, 2]
    assert json.loads((first / "finished.json").read_text())["steps"] == 3
    assert json.loads((moved / "finished.json").read_text())["steps"] == 2
    for name in ("config.json", "run.json"):
        assert (first / name).is_file() and (moved / name).is_file(), name
    assert len(list(first.glob("events.out.tfevents.*"))) == 1
    assert len(list(moved.glob("events.out.tfevents.*"))) == 1
    assert (first / "train.log").read_text() == "the study runner's log\n"


@pytest.mark.slow
def test_a_resumed_run_appends_to_its_checkpoint_folders_run_dir(tmp_path):
    """--ckpt-dir without --run-dir: the run directory is CKPT/run. A run that halts at step 3
    (an injected NaN) after saving step 2, restarted, resumes from step 2 and appends step 3 to
    the same metrics.jsonl; the first attempt's halted.json is gone, nothing is moved aside, and
    the checkpoint folder's readers see only its checkpoints."""
    from aoe_megatron.checkpoint.layout import checkpoints

    ck = tmp_path / "ck"
    args = ["--train-iters", "3", "--save-interval", "1", "--ckpt-dir", ck]
    halted = _train([*args, "--inject-nonfinite", "3"])
    assert halted.returncode == 3, halted.output[-3000:]
    run_dir = ck / "run"
    assert json.loads((run_dir / "halted.json").read_text())["reason"] == "NonFiniteError"
    assert _steps(run_dir) == [1, 2] and _steps(run_dir, "nonfinite") == [3]

    out = _train(args)
    assert out.returncode == 0, out.output[-3000:]
    assert f"resumed from {ck / 'step_00000002'}" in out.output
    assert _steps(run_dir) == [1, 2, 3] and _steps(run_dir, "nonfinite") == [3]
    assert not (run_dir / "halted.json").exists() and (run_dir / "finished.json").is_file()
    assert not (run_dir / "previous").exists() and "held an earlier run" not in out.output
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 2  # one per attempt
    assert json.loads((run_dir / "config.json").read_text())["train"]["run_dir"] == str(run_dir)
    assert [p.name for p in checkpoints(ck)] == ["step_00000001", "step_00000002",
                                                 "step_00000003"]
    assert f"run directory: {run_dir}" in out.output
