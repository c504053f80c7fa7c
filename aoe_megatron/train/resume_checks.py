"""What a resume checks against the checkpoint before anything loads: the model and the global
batch (``check_config``: must be the checkpoint's) and the learning-rate schedule
(``check_schedule``: as Megatron-LM, a change is refused unless the command says which schedule
to continue on, with ``--override-opt_param-scheduler`` or
``--use-checkpoint-opt_param-scheduler``).

Pure functions of the checkpoint's state record and this run's record (``Run.record()``);
``checkpoint.resume`` calls them (and ``aoe_megatron.checkpoint.model.check_release``: can the
installed megatron-core read it).
"""

from __future__ import annotations

import json
from typing import Optional

from aoe_megatron.train.errors import TrainingHalted
from aoe_megatron.train.schedule import Schedule, run_schedule
from aoe_megatron.train.values import upgrade_train_keys

OVERRIDE = "--override-opt_param-scheduler"
USE_CHECKPOINT = "--use-checkpoint-opt_param-scheduler"

#: Each setting of a schedule by the words a user knows it by (its flags).
LABELS = {"total_steps": "total steps (--train-iters, or --train-tokens in steps)",
          "warmup_steps": "warm-up steps (--lr-warmup-iters, at most total steps - 1)",
          "lr": "--lr", "min_lr": "--min-lr"}


class ResumeError(TrainingHalted):
    """A ckpt dir that cannot be resumed as asked; the message says why and what to do (a
    restart would fail alike: the run halts, see ``faults.TrainingHalted``)."""


def check_config(state: dict, config: dict, path) -> None:
    """The model and the batch layout of the data must be those of the checkpoint."""
    saved = state.get("config") or {}
    now = json.loads(json.dumps(config, default=str))  # as state.json holds it (lists, not tuples)
    diffs = [f"model.{k}: {saved['model'].get(k)!r} in the checkpoint, {v!r} now"
             for k, v in now["model"].items()
             if "model" in saved and saved["model"].get(k) != v]
    for key in ("global_batch_size",):
        old = saved.get("train", {}).get(key)
        if old is not None and old != now["train"][key]:
            diffs.append(f"train.{key}: {old!r} in the checkpoint, {now['train'][key]!r} now "
                         f"(the data position is counted in steps of the global batch)")
    if diffs:
        raise ResumeError(f"{path} cannot be resumed with these settings:\n  " + "\n  ".join(diffs))


def schedule_of_record(config: dict) -> Optional[Schedule]:
    """The schedule a run record (``Run.record()``, a checkpoint's ``config``) trains on; None
    where the record lacks a setting it needs."""
    train = upgrade_train_keys(config.get("train") or {}, warn=False)  # a record: old keys too
    model = config.get("model") or {}
    try:
        steps = train.get("train_iters")
        if steps is None:  # NOTE: TrainConfig.steps, on the record's plain values
            steps = -(-train["train_tokens"] // (train["global_batch_size"] * model["seq_length"]))
        return run_schedule(lr=train["lr"], min_lr=train["min_lr"],
                            warmup_steps=train["lr_warmup_iters"], total_steps=steps)
    except (KeyError, TypeError):
        return None


def saved_schedule(state: dict) -> Optional[Schedule]:
    """The schedule a checkpoint was trained on: its ``schedule`` record, or, in checkpoints
    written before that record, the one its ``config`` derives (what such runs trained on)."""
    if state.get("schedule"):
        return Schedule(**state["schedule"])
    return schedule_of_record(state.get("config") or {})


def schedule_changes(saved: Schedule, now: Schedule) -> dict:
    """{setting: (the checkpoint's value, this run's)} for each setting that differs."""
    old, new = saved.record(), now.record()
    return {key: (old[key], new[key]) for key in LABELS if old[key] != new[key]}


def _rate(schedule: Schedule, step: int) -> str:
    return f"{schedule.lr_at(step):.4g}"


def check_schedule(state: dict, config: dict, path) -> tuple:
    """(the schedule to put in force instead of this run's, or None; a note for the console, or
    None). Refuses (``ResumeError``) a schedule that differs from the checkpoint's unless the
    record's train settings choose one: ``override_opt_param_scheduler`` (this run's) or
    ``use_checkpoint_opt_param_scheduler`` (the checkpoint's)."""
    saved, now = saved_schedule(state), schedule_of_record(config)
    if saved is None or now is None:
        return None, None  # nothing to compare (a record without the settings)
    changes = schedule_changes(saved, now)
    if not changes:
        return None, None
    train, step = config.get("train") or {}, state.get("scheduler_last_epoch", state.get("step", 0))
    if train.get("override_opt_param_scheduler"):
        listed = "; ".join(f"{LABELS[k]} {old} -> {new}" for k, (old, new) in changes.items())
        return None, (f"note: {OVERRIDE}: continuing {path} on this command's learning-rate "
                      f"schedule, not the checkpoint's: {listed} (the next step's lr "
                      f"{_rate(now, step)} instead of {_rate(saved, step)})")
    if train.get("use_checkpoint_opt_param_scheduler"):
        ignored = "; ".join(f"{LABELS[k]} {new} (the checkpoint's: {old})"
                            for k, (old, new) in changes.items())
        return saved, (f"note: {USE_CHECKPOINT}: continuing on {path}'s learning-rate schedule "
                       f"(lr {saved.lr}, min-lr {saved.min_lr}, {saved.warmup_steps} warm-up "
                       f"steps, {saved.total_steps} total steps; at min-lr after them); this "
                       f"command's is ignored: {ignored}")
    listed = "\n  ".join(f"{LABELS[k]}: {old} in the checkpoint, {new} now"
                         for k, (old, new) in changes.items())
    raise ResumeError(
        f"{path} was trained on another learning-rate schedule than this command's:\n  {listed}\n"
        f"Resuming would change the learning rate from the next step on (lr {_rate(now, step)} "
        f"instead of {_rate(saved, step)}). Choose: {OVERRIDE} continues on this command's "
        f"schedule (its values replace the checkpoint's); {USE_CHECKPOINT} continues on the "
        f"checkpoint's (this command's values are ignored for the schedule; the run still trains "
        f"to its own length, at the checkpoint's min-lr past the schedule's end)")
