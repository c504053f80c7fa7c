"""Where megatron-core's dataset sample indices are cached (``--data-cache-path``), and what a rank
is told when it cannot write or read them.

megatron-core's ``GPTDataset`` (and ``BlendedDataset``) keep three ``.npy`` index files and a
description per split, named by a hash of everything that decides the samples (prefixes, split,
seed, sequence length, sample count, the tokenizer view's identifiers). Global rank 0 builds a
missing index while every other rank waits at a barrier; the others then load rank 0's files and
never build them themselves. Without a cache path it writes into ``{prefix's folder}/cache/``:
a read-only shared corpus fails there, and per-node copies of a corpus leave the other nodes'
ranks without the files. So training always passes a cache path, by default beside the run
directory (``default_path``), and says which.

A cluster job builds nothing if the cache was built ahead (``aoe-train ... --build-data-index-only
--world-size N`` on a CPU node, ``train/data_index.py``): a large blend's build on rank 0 can
outlast the collective timeout the other ranks wait under.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

DEFAULT_NAME = "data-cache"
"""The default cache folder's name, beside the run directory."""


class DataCacheError(RuntimeError):
    """A rank cannot write or read the data index cache; the message names the path and the fix."""


def default_path(cfg) -> str:
    """``--data-cache-path``, else ``data-cache`` beside the run directory: ``--run-dir``'s
    parent, else the checkpoint folder (beside its default run directory ``SAVE/run``), else
    ``runs/`` (beside a default ``runs/<time>-<preset>``). Every rank computes the same path
    from the settings alone (the default run directory is rank 0's: ``train/run_dir.py``)."""
    if cfg.data_cache_path:
        return str(cfg.data_cache_path)
    if cfg.run_dir:
        return str(Path(cfg.run_dir).parent / DEFAULT_NAME)
    if cfg.save_dir():
        return str(Path(cfg.save_dir()) / DEFAULT_NAME)
    return str(Path("runs") / DEFAULT_NAME)


def index_files(cache_dir) -> dict:
    """{file name: mtime_ns} of the index files in ``cache_dir`` (empty if there is none)."""
    try:
        return {e.name: e.stat().st_mtime_ns for e in os.scandir(cache_dir) if e.is_file()}
    except FileNotFoundError:
        return {}


def prepare(cache_dir) -> None:
    """Rank 0, before the build: the folder exists and can be written (a clear error if not)."""
    path = Path(cache_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise DataCacheError(
            f"cannot write the data index cache at {path.resolve()} ({type(err).__name__}: "
            f"{err.strerror or err}): give --data-cache-path a folder this job can write, on a "
            f"filesystem every node sees") from err


def unreadable(err: OSError, cache_dir, rank: int) -> Optional[DataCacheError]:
    """The error to raise for ``err`` (a file of ``cache_dir`` this rank could not open), or None
    when ``err`` is about another file."""
    name = getattr(err, "filename", None)
    if not name:
        return None
    root = os.path.realpath(cache_dir)
    if not os.path.realpath(name).startswith(root + os.sep):
        return None
    return DataCacheError(
        f"rank {rank} cannot read the data index cache that rank 0 wrote ({name}): "
        f"--data-cache-path ({cache_dir}) must name a folder every node sees at the same path (a "
        f"shared filesystem), or build the cache ahead with `aoe-train ... "
        f"--build-data-index-only --world-size N` and copy it to that path on every node")


def describe(before: dict, after: dict, cache_dir, seconds: float) -> str:
    """One line for the log: whether this run built index files or reused them."""
    new = sorted(set(after) - set(before))
    changed = sorted(n for n in before if n in after and after[n] != before[n])
    where = Path(cache_dir).resolve()
    if not new and not changed:
        return f"data index cache: {where}: reused ({len(after)} files, {seconds:.1f} s)"
    return (f"data index cache: {where}: built {len(new) + len(changed)} files in "
            f"{seconds:.1f} s (a job with these settings reuses them)")
