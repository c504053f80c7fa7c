"""A resume whose learning-rate schedule differs from the checkpoint's (a longer --train-iters,
another --lr, --min-lr or --lr-warmup-iters): refused, as in Megatron-LM, unless
--override-opt_param-scheduler (this command's schedule) or --use-checkpoint-opt_param-scheduler
(the checkpoint's) says which to continue on. It used to re-derive the schedule silently."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from aoe_megatron.runtime import launch
from aoe_megatron.train.loop import EXIT_HALTED, main
from aoe_megatron.train.resume_checks import ResumeError, check_schedule, saved_schedule
from aoe_megatron.train.schedule import paper_lr

ROOT = Path(__file__).resolve().parents[1]
PEAK, FINAL = 3e-3, 3e-4  # the tiny preset's lr and min_lr
SAVED_AT, OLD_TOTAL, NEW_TOTAL = 3, 6, 8
#: One process, a 512-token vocabulary: a few steps take a second or two.
SETTINGS = ["--preset", "tiny", "--set", "vocab_size=512", "--mock-data", "--global-batch-size",
            "2", "--micro-batch-size", "1", "--lr-warmup-iters", "1", "--eval-interval", "0",
            "--log-interval", "1"]


def _train(args: list, *, run_dir: Path) -> launch.Finished:
    return launch.run([*SETTINGS, *args, "--run-dir", run_dir], nproc=1, threads=1, cwd=ROOT,
                      timeout=300)


def _lrs(run_dir: Path) -> dict:
    """The lr of each logged training step, from metrics.jsonl."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["lr"] for r in map(json.loads, lines) if r["kind"] == "train"}


def _lr(step: int, total: int, peak: float = PEAK) -> float:
    """The lr logged at ``step`` (from 1) on the schedule of ``total`` steps."""
    return paper_lr(step - 1, peak=peak, final=FINAL, warmup_steps=1, total_steps=total)


def _state(step_dir: Path) -> dict:
    return json.loads((step_dir / "state.json").read_text())


@pytest.fixture(scope="module")
def mid_schedule(tmp_path_factory) -> Path:
    """A --load folder holding one checkpoint: step 3 of a 6-step run (the middle of its cosine)."""
    tmp = tmp_path_factory.mktemp("resume_schedule")
    first = _train(["--train-iters", str(OLD_TOTAL), "--save-interval", str(SAVED_AT), "--save",
                    tmp / "ck"], run_dir=tmp / "run")
    assert first.returncode == 0, first.output[-4000:]
    lrs = _lrs(tmp / "run")
    assert lrs == pytest.approx({s: _lr(s, OLD_TOTAL) for s in range(1, OLD_TOTAL + 1)}, rel=1e-12)
    name = f"step_{SAVED_AT:08d}"
    shutil.copytree(tmp / "ck" / name, tmp / "ck3" / name)
    (tmp / "ck3" / "latest").write_text(name + "\n")
    return tmp / "ck3"


@pytest.mark.slow
def test_a_longer_run_is_refused_naming_both_lengths_and_the_two_flags(mid_schedule, tmp_path):
    run_dir = tmp_path / "run"
    refused = _train(["--train-iters", str(NEW_TOTAL), "--load", mid_schedule, "--save",
                      tmp_path / "ck"], run_dir=run_dir)
    out = refused.output
    assert refused.returncode == EXIT_HALTED, out[-4000:]
    step_dir = mid_schedule / f"step_{SAVED_AT:08d}"
    assert f"error: {step_dir} was trained on another learning-rate schedule" in out, out[-4000:]
    assert (f"total steps (--train-iters, or --train-tokens in steps): {OLD_TOTAL} in the "
            f"checkpoint, {NEW_TOTAL} now") in out
    assert "--lr:" not in out and "warm-up steps" not in out  # only what differs
    assert "--override-opt_param-scheduler continues on this command's schedule" in out
    assert "--use-checkpoint-opt_param-scheduler continues on the checkpoint's" in out
    halted = json.loads((run_dir / "halted.json").read_text())
    assert halted["reason"] == "ResumeError" and "--train-iters" in halted["message"]
    assert not (run_dir / "metrics.jsonl").exists() or not _lrs(run_dir)  # no step was taken
    assert not list((tmp_path / "ck").glob("step_*"))


@pytest.mark.slow
def test_override_continues_on_this_commands_schedule(mid_schedule, tmp_path):
    run_dir, ck = tmp_path / "run", tmp_path / "ck"
    done = _train(["--train-iters", str(NEW_TOTAL), "--load", mid_schedule, "--save", ck,
                   "--override-opt_param-scheduler"], run_dir=run_dir)
    out = done.output
    assert done.returncode == 0, out[-4000:]
    assert out.count("note: --override-opt_param-scheduler: continuing") == 1, out[-4000:]
    assert f"(--train-iters, or --train-tokens in steps) {OLD_TOTAL} -> {NEW_TOTAL}" in out
    resumed = range(SAVED_AT + 1, NEW_TOTAL + 1)
    assert _lrs(run_dir) == pytest.approx({s: _lr(s, NEW_TOTAL) for s in resumed}, rel=1e-12)
    assert _lrs(run_dir)[SAVED_AT + 1] != pytest.approx(_lr(SAVED_AT + 1, OLD_TOTAL))
    # every checkpoint records the schedule it trained on
    assert _state(mid_schedule / f"step_{SAVED_AT:08d}")["schedule"] == {
        "lr": PEAK, "min_lr": FINAL, "warmup_steps": 1, "total_steps": OLD_TOTAL}
    assert _state(ck / f"step_{NEW_TOTAL:08d}")["schedule"]["total_steps"] == NEW_TOTAL


@pytest.mark.slow
def test_use_checkpoint_continues_on_the_checkpoints_schedule(mid_schedule, tmp_path):
    """Another --lr too: the optimizer's base rate follows the checkpoint's peak. Past the old
    schedule's last step the rate stays at its min-lr."""
    run_dir, ck = tmp_path / "run", tmp_path / "ck"
    done = _train(["--train-iters", str(NEW_TOTAL), "--lr", "1e-3", "--load", mid_schedule,
                   "--save", ck, "--use-checkpoint-opt_param-scheduler"], run_dir=run_dir)
    out = done.output
    assert done.returncode == 0, out[-4000:]
    assert out.count("note: --use-checkpoint-opt_param-scheduler: continuing on") == 1, out[-4000:]
    assert "--lr 0.001 (the checkpoint's: 0.003)" in out
    lrs = _lrs(run_dir)
    assert lrs == pytest.approx({s: _lr(s, OLD_TOTAL) for s in range(SAVED_AT + 1, NEW_TOTAL + 1)},
                                rel=1e-12)
    assert lrs[OLD_TOTAL + 1] == lrs[NEW_TOTAL] == pytest.approx(FINAL, rel=1e-12)
    assert _state(ck / f"step_{NEW_TOTAL:08d}")["schedule"] == {  # the schedule in force
        "lr": PEAK, "min_lr": FINAL, "warmup_steps": 1, "total_steps": OLD_TOTAL}


def test_both_flags_are_refused_before_any_process_group(tmp_path, capsys, monkeypatch):
    from aoe_megatron.runtime import distributed

    def no_process_group(*args, **kwargs):
        raise AssertionError("a process group was started")

    monkeypatch.setattr(distributed, "init_megatron", no_process_group)
    code = main([*SETTINGS, "--train-iters", "2", "--run-dir", str(tmp_path / "run"),
                 "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"])
    assert code == 2
    err = capsys.readouterr().err
    assert ("error: --override-opt_param-scheduler (this command's learning-rate schedule) and "
            "--use-checkpoint-opt_param-scheduler (the checkpoint's) exclude each other") in err
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_without_a_schedule_record_is_judged_by_its_config():
    """Checkpoints written before the record: the schedule their config derives (--train-tokens
    in steps, warm-up cut to total - 1) is what they trained on."""
    config = {"train": {"lr": PEAK, "min_lr": FINAL, "lr_warmup_iters": 30, "train_iters": None,
                        "train_tokens": 1000, "global_batch_size": 4},
              "model": {"seq_length": 64}}
    old = {"config": config, "step": 2, "scheduler_last_epoch": 2}
    assert saved_schedule(old).record() == {"lr": PEAK, "min_lr": FINAL, "warmup_steps": 3,
                                            "total_steps": 4}
    assert check_schedule(old, config, "ck/step_00000002") == (None, None)
    # a record written before the train keys took Megatron-LM's names reads the same
    before = {"train": {"lr": PEAK, "min_lr": FINAL, "warmup_steps": 30, "train_steps": None,
                        "train_tokens": 1000, "global_batch_size": 4}, "model": {"seq_length": 64}}
    assert saved_schedule({**old, "config": before}).record() == saved_schedule(old).record()
    longer = {"train": {**config["train"], "train_tokens": 2000, "min_lr": 1e-4},
              "model": config["model"]}
    with pytest.raises(ResumeError) as err:
        check_schedule(old, longer, "ck/step_00000002")
    for line in ("total steps (--train-iters, or --train-tokens in steps): 4 in the checkpoint, "
                 "8 now", "warm-up steps (--lr-warmup-iters, at most total steps - 1): 3 in the "
                 "checkpoint, 7 now", "--min-lr: 0.0003 in the checkpoint, 0.0001 now"):
        assert line in str(err.value)
