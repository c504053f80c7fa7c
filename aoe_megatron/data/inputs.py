"""Which files an ``aoe-preprocess`` run reads: its ``--input`` values (files, globs, folders,
``NAME=GLOB``) as named groups of files, each checked before anything is read."""

from __future__ import annotations

import glob
import os
from pathlib import Path

from aoe_megatron.data.reader import SUPPORTED_SUFFIXES


class PreprocessError(RuntimeError):
    """The run cannot produce a valid output (bad arguments, --strict rejections, no documents)."""


FOLDER_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
"""What a folder given as an input contributes: its files with these endings (not its
subfolders')."""


def _folder_files(folder: str) -> list[str]:
    files = sorted(str(p) for p in Path(folder).iterdir()
                   if p.is_file() and p.name.endswith(FOLDER_SUFFIXES))
    if not files:
        raise PreprocessError(f"input folder {folder!r} holds no {', '.join(FOLDER_SUFFIXES)} file "
                              f"(subfolders are not searched: give a glob such as "
                              f"'{folder.rstrip(os.sep)}/**/*.jsonl' for them)")
    return files


def resolve_inputs(inputs) -> list[tuple[str, list[str]]]:
    """[(subset name, sorted files)] for each --input; a glob matching nothing is an error. A
    folder stands for its ``FOLDER_SUFFIXES`` files and names its subset."""
    groups = []
    for spec in inputs:
        if "=" in spec and not os.path.exists(spec):
            name, pattern = spec.split("=", 1)
        else:
            name, pattern = "", spec
        if os.path.isdir(pattern):
            groups.append((name or Path(pattern).resolve().name, _folder_files(pattern)))
            continue
        files = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        files = [f for f in files if not os.path.isdir(f)]
        if not files or not all(os.path.isfile(f) for f in files):
            raise PreprocessError(f"input {pattern!r} matches no file")
        bad = [f for f in files if not f.endswith(SUPPORTED_SUFFIXES)]
        if bad:
            raise PreprocessError(
                f"unsupported input {bad[0]!r}: expected one of {', '.join(SUPPORTED_SUFFIXES)}"
            )
        if not name:
            name = Path(files[0]).name.split(".")[0] if len(files) == 1 else Path(pattern).parent.name
        groups.append((name, files))
    return groups
