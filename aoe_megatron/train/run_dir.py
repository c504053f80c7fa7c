"""The run directory (``--run-dir``): where a run's TensorBoard logs, ``metrics.jsonl`` and records
go. One run per folder:

- Without ``--run-dir``, a run that saves checkpoints (``--save`` / ``--ckpt-dir``) uses
  ``SAVE/run``, so a restarted or requeued command keeps appending to one folder; any other run
  gets a new ``runs/<UTC YYYYmmdd-HHMMSS>-<preset>`` (``-2``, ``-3``, ... when that is taken).
- A run that resumes a checkpoint appends to its run directory.
- A run that resumes nothing (from scratch, or from ``--load-weights``) in a folder that holds an
  earlier run's files moves those files to ``RUN_DIR/previous/<UTC YYYYmmdd-HHMMSS>/`` (the time
  of the oldest of them: about when that run started) and says so. Nothing is deleted, and the
  folder's metrics.jsonl and TensorBoard files are then this run's alone.

Only what training writes is moved (``RUN_FILES`` and TensorBoard's event files): anything else
in the folder stays where it is, such as the study runner's preset.yaml, study-run.json and
train.log, or a checkpoint folder.

NOTE: rank 0 alone resolves and uses the run directory. The default may be a folder that rank 0
has just created, which the other ranks could not name alike; they never write there.
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path
from typing import Callable, Optional

from aoe_megatron.train.faults import CLEARED_HALT, HALTED

RUN_FILES = ("metrics.jsonl", "config.json", "run.json", "finished.json", HALTED, CLEARED_HALT)
"""The files a training run writes into its run directory (an earlier attempt's cleared
halted.json included: ``faults.clear_halt_record``)."""
EVENTS = "events.out.tfevents.*"
"""TensorBoard's event files (one per process that wrote the run's scalars)."""
PREVIOUS = "previous"
IN_SAVE_DIR = "run"
"""The default run directory's name inside a run's checkpoint folder (checkpoint readers and
retention only look at ``step_*`` folders there)."""
_STAMP = "%Y%m%d-%H%M%S"


def resolve_run_dir(cfg) -> str:
    """The run directory of ``cfg`` (a ``TrainConfig``): ``--run-dir``, else ``SAVE/run``, else a
    new ``runs/<UTC time>-<preset>``. The last is created here, so that two launches in one second
    get two folders: call this on rank 0 only."""
    if cfg.run_dir:
        return str(cfg.run_dir)
    if cfg.save_dir():
        return str(Path(cfg.save_dir()) / IN_SAVE_DIR)
    name = f"{time.strftime(_STAMP, time.gmtime())}-{Path(str(cfg.preset)).stem}"
    return str(_claim(Path("runs"), name))


def _claim(parent: Path, name: str) -> Path:
    """Create and return ``parent/name``, or ``name-2``, ``name-3``, ... where that exists."""
    parent.mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        path = parent / (name if n == 1 else f"{name}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path


def run_files(run_dir) -> list:
    """The files of a run in ``run_dir`` (``RUN_FILES``, TensorBoard event files), sorted."""
    root = Path(run_dir)
    if not root.is_dir():
        return []
    found = [root / name for name in RUN_FILES] + list(root.glob(EVENTS))
    return sorted(p for p in found if p.is_file())


def move_aside(run_dir) -> Optional[Path]:
    """Move the run files of ``run_dir`` into a new ``run_dir/previous/<UTC time>/``, named for the
    oldest of them; returns that folder, or None when there were none."""
    files = run_files(run_dir)
    if not files:
        return None
    began = min(p.stat().st_mtime for p in files)
    dest = _claim(Path(run_dir) / PREVIOUS, time.strftime(_STAMP, time.gmtime(began)))
    for path in files:
        os.replace(path, dest / (HALTED if path.name == CLEARED_HALT else path.name))
    return dest


def open_run_dir(run_dir, *, resumed: bool, say: Callable[[str], None] = print) -> None:
    """Ready ``run_dir`` for a run, before the run writes anything there (rank 0): a ``resumed``
    run continues the folder's record; any other moves an earlier run's files aside."""
    root = Path(run_dir)
    if resumed:
        (root / CLEARED_HALT).unlink(missing_ok=True)  # that attempt's halt is past
    elif (dest := move_aside(root)) is not None:
        say(f"{root} held an earlier run: its files are now in {dest} (a run that resumes no "
            f"checkpoint starts a record of its own)")
    root.mkdir(parents=True, exist_ok=True)
