"""Where the training data is: dataset prefixes as users give them, found on disk, with one
message per kind of mistake.

Accepted forms (``aoe-train --data-path``, or the per-split flags):
  data/rp_text_document                    one prefix (Megatron-LM's form)
  0.7 data/cc_text_document 0.3 data/c4_text_document
                                           weights and prefixes alternating (Megatron-LM)
  data/cc_text_document data/c4_text_document
                                           prefixes without weights: weighted by their size
  run/data-redpajama.yaml                  a data config (``data/blend.py``); a file name alone
                                           also finds the package's own (data-shakespeare.yaml)

A relative prefix resolves against the working directory, then (in a data config) against the
config's folder; an error names every path tried. Resolved prefixes are absolute, so what a
checkpoint records works from any folder.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Optional, Sequence

from aoe_megatron.data.integrity import read_idx_header
from aoe_megatron.runtime import resources

YAML_SUFFIXES = (".yaml", ".yml")
DATASET_FILES = (".bin", ".idx")


class DataPathError(ValueError):
    """A data path that names no usable dataset (the message says which and why)."""


def is_config(value: str) -> bool:
    """Whether a ``--data-path`` value names a data config rather than a dataset prefix."""
    return str(value).endswith(YAML_SUFFIXES)


def find_config(value: str) -> Path:
    """A data config: the path as given, else the package's own config of that file name."""
    path = Path(value)
    if path.is_file():
        return path

    packaged = resources.path(path.name)
    if path.parent == Path(".") and packaged.is_file():
        return packaged
    shipped = sorted(p.name for p in resources.root().glob("data-*.yaml"))
    raise DataPathError(f"no data config {value}: no such file (the package ships {shipped})")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def weighted_list(values: Sequence[str], flag: str) -> tuple[list, Optional[list]]:
    """Megatron-LM's blend list: ``[P]``, ``[W1, P1, W2, P2, ...]`` or ``[P1, P2, ...]``.

    Returns (prefixes, weights); weights None when none were given (the caller weights the
    datasets by size, as Megatron-LM does)."""
    values = [str(v) for v in values]
    numbers = [_is_number(v) for v in values]
    if not any(numbers):
        return values, ([1.0] if len(values) == 1 else None)
    if len(values) % 2 or not all(numbers[0::2]) or any(numbers[1::2]):
        raise DataPathError(f"{flag} {' '.join(values)}: give prefixes alone, or weights and "
                            f"prefixes alternating (W1 PREFIX1 W2 PREFIX2 ...)")
    weights = [float(v) for v in values[0::2]]
    bad = [w for w in weights if not w > 0]
    if bad:
        raise DataPathError(f"{flag}: weights must be positive, got {bad[0]:g}")
    return values[1::2], weights


def _nearest(candidate: Path) -> str:
    """A hint naming the existing dataset closest to ``candidate``, or why there is none."""
    folder = candidate.parent
    if not folder.is_dir():
        return f"; the folder {folder} does not exist"
    names = sorted(p.name[:-4] for p in folder.glob("*.idx"))
    if not names:
        return f"; {folder} holds no dataset (.idx file)"
    documents = [n for n in names if n.startswith(candidate.name + "_") and
                 n.endswith("_document")]
    if documents:
        return (f"; did you mean {folder / documents[0]}? aoe-preprocess (and Megatron-LM) name "
                f"a dataset after its --output-prefix plus _{{json key}}_document")
    close = difflib.get_close_matches(candidate.name, names, n=1, cutoff=0.5)
    return (f"; the nearest dataset there is {folder / close[0]}" if close else
            f"; datasets in {folder}: {', '.join(names[:5])}{', ...' if len(names) > 5 else ''}")


def resolve_prefix(prefix: str, bases: Sequence[Path] = ()) -> str:
    """The absolute prefix of an existing dataset (``PREFIX.bin`` and ``PREFIX.idx``).

    ``prefix`` relative: tried against the working directory, then each of ``bases``."""
    text = str(prefix)
    for suffix in (*DATASET_FILES, ".manifest.json"):
        if text.endswith(suffix):
            stem = text[:-len(suffix)]
            raise DataPathError(f"{text} is one of a dataset's files: give its prefix, {stem} "
                                f"(which names {stem}.bin and {stem}.idx)")
    if os.path.isabs(text):
        candidates = [Path(text)]
    else:
        candidates = list(dict.fromkeys([Path.cwd() / text, *(Path(b) / text for b in bases)]))
    for candidate in candidates:
        found = [os.path.isfile(f"{candidate}{ext}") for ext in DATASET_FILES]
        if all(found):
            return os.path.abspath(candidate)
        if any(found):
            have, lack = DATASET_FILES if found[0] else DATASET_FILES[::-1]
            raise DataPathError(f"{candidate}{have} exists but {candidate}{lack} is missing: a "
                                f"dataset is the pair (an interrupted copy?)")
    tried = ", ".join(f"{c}.bin/.idx" for c in candidates)
    raise DataPathError(f"no dataset {text}: tried {tried}{_nearest(candidates[0])}")


def sizes_as_weights(prefixes: Sequence[str]) -> list:
    """Weights for a blend given without any: each dataset's token count, as Megatron-LM blends
    unweighted prefixes by their size (read from the files' sizes: no file is opened)."""
    weights = []
    for prefix in prefixes:
        header = read_idx_header(prefix)
        weights.append(float(os.path.getsize(f"{prefix}.bin") // header.itemsize) or 1.0)
    return weights
