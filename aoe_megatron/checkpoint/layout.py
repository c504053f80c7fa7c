"""A training checkpoint folder on disk: its file names, its pointers and how a path resolves.

    CKPT_DIR/                 what --save / --load / --ckpt-dir name
      step_00000100/          one checkpoint (``step_name``): STATE (step, layout, config, ...),
                              model/, optimizer/, rng/, MANIFEST (every file's size and sha256,
                              written last: ``integrity.py``)
      step_00000200.partial-* a save in progress (renamed when complete on every rank)
      latest                  one line naming the newest complete checkpoint (``LATEST``)
      last_verified           the newest checkpoint that passed a check (``VERIFIED``)

Every reader of checkpoints finds them here: the trainer's resume and save, the Hugging Face
export, the study's tools, ``aoe-checkpoints``. Only this room spells these names (a test reads
the package's string literals).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Optional

from aoe_megatron.checkpoint.errors import CheckpointNotFound

LATEST = "latest"
VERIFIED = "last_verified"
STATE = "state.json"
MANIFEST = "manifest.json"
#: The checkpoint format this code writes: 2 = dist-checkpointed optimizer state and a manifest.
FORMAT = 2
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def is_checkpoint(path) -> bool:
    """``path`` is one checkpoint (a step folder with its state file)."""
    return (Path(path) / STATE).is_file()


def checkpoints(ckpt_dir) -> list:
    """Complete (renamed) checkpoint folders of ``ckpt_dir``, oldest first."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name))


def read_pointer(ckpt_dir, name: str) -> Optional[str]:
    """The checkpoint name a pointer file (``LATEST``, ``VERIFIED``) holds; None without one."""
    path = Path(ckpt_dir) / name
    return path.read_text().strip() if path.is_file() else None


def write_pointer(ckpt_dir, name: str, target: str) -> None:
    """Point ``name`` at checkpoint ``target``, atomically (a crash leaves the old pointer)."""
    tmp = Path(ckpt_dir) / f"{name}.partial"
    tmp.write_text(target + "\n")
    os.replace(tmp, Path(ckpt_dir) / name)


def latest_checkpoint(ckpt_dir) -> Optional[Path]:
    """The checkpoint ``LATEST`` names (None without the pointer); FileNotFoundError if it names
    something that is not a complete checkpoint."""
    target = read_pointer(ckpt_dir, LATEST)
    if target is None:
        return None
    path = Path(ckpt_dir) / target
    if not is_checkpoint(path):
        raise FileNotFoundError(f"{Path(ckpt_dir) / LATEST} names {path}, which is not a complete "
                                f"checkpoint")
    return path


def resolve(path) -> Path:
    """The checkpoint ``path`` means: itself if it is one, else the one its ``LATEST`` names.
    ``CheckpointNotFound`` says which it is not, and what to pass instead."""
    path = Path(path)
    if is_checkpoint(path):
        return path
    if not path.exists():
        raise CheckpointNotFound(f"checkpoint {path} does not exist")
    if not path.is_dir():
        raise CheckpointNotFound(f"{path} is a file, not a checkpoint folder")
    try:
        latest = latest_checkpoint(path)
    except FileNotFoundError as err:
        raise CheckpointNotFound(str(err)) from None
    if latest is None:
        raise CheckpointNotFound(
            f"{path} is not a checkpoint (no {STATE}) nor a checkpoint folder (no '{LATEST}' "
            f"file): pass a step_N folder, or the --ckpt-dir holding '{LATEST}'")
    return latest


def read_state(step_dir) -> dict:
    """A checkpoint's ``STATE`` record (step, layout, config, ...)."""
    return json.loads((Path(step_dir) / STATE).read_text())


def state_path(step_dir) -> Path:
    return Path(step_dir) / STATE


def manifest_path(step_dir) -> Path:
    return Path(step_dir) / MANIFEST
