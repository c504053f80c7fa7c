"""The package's own files (presets, DeepSpeed configs, the Slurm template, data and study
configs): the repository's ``run/`` folder, installed as the package ``aoe_megatron._run``.
Found through ``importlib.resources``, so a wheel install and a checkout read the same files;
nothing here is a path into the source tree."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

PACKAGE = "aoe_megatron._run"


def root() -> Path:
    """The folder holding the package data (a real folder: the package is never zipped)."""
    return Path(str(resources.files(PACKAGE)))


def path(relative: str) -> Path:
    """``path("presets/tiny.yaml")``: a file or folder of the package data (it may not exist:
    callers that take a user's name say which names there are)."""
    return root() / relative


def names(folder: str, suffix: str = ".yaml") -> list[str]:
    """The stems of ``folder``'s files with ``suffix`` (e.g. the preset names)."""
    return sorted(p.stem for p in path(folder).glob(f"*{suffix}"))
