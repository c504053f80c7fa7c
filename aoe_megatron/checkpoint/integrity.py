"""Checkpoint manifests: every file of a checkpoint with its size and sha256.

``manifest.json`` is the last file written into a checkpoint before it is renamed into place.
Hashing and verification are split over the ranks (file i goes to rank i mod world size), so a
checkpoint of many shards is checked in parallel on a shared filesystem.

Every reader of a checkpoint (resume, ``--load-weights``, the HF export, the study's tools) checks
it first: resume through ``verify`` (it falls back to an older checkpoint), the others through
``require_verified`` (they refuse it).

Writing a manifest reads no file that was hashed as it was written: megatron-core's writers leave
a digest record beside each data file (``patches/mcore_dist_ckpt_write_digests.py``,
``runtime/hashing.py``), which stands for a re-read while the file's size and mtime are those
recorded; the records are removed before the manifest is written and are never part of it.

What scales: sizes are always checked; hashing runs on ``THREADS`` threads in each rank (hashlib
releases the GIL). Resume alone may trust a stamp: ``.verified.json`` records, for each file
hashed (when the checkpoint was written, or by a later resume), its size, mtime and ctime; a
resume re-hashes only files whose stamp changed since. A same-size corruption that leaves both
times alone (media bit rot under a file system that does not checksum) passes a resume; export,
``--load-weights``, the study's readers and ``aoe-checkpoints verify`` hash everything.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional

from aoe_megatron.checkpoint.errors import CheckpointDamaged
from aoe_megatron.checkpoint.layout import MANIFEST, read_state
from aoe_megatron.runtime.hashing import (RECORD_SUFFIX, is_record, record_path, recorded_sha256,
                                           sha256_bytes, sha256_file)

FORMAT = 1
MANIFESTS_SINCE = 2
"""The checkpoint format (``checkpoint.FORMAT``, state.json's "format") that added manifest.json."""
STAMPS = ".verified.json"
"""Per checkpoint: the stamp (size, mtime, ctime) of each file when last hashed; resume's shortcut."""
THREADS = max(1, int(os.environ.get("AOE_VERIFY_THREADS", min(8, os.cpu_count() or 1))))
"""Files each rank hashes at once (``AOE_VERIFY_THREADS``)."""


def _files(root: Path) -> list:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.is_file() and p.name not in (MANIFEST, STAMPS)
                  and not p.name.endswith(".tmp") and not is_record(p.name))


def _stamp(path: Path) -> list:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _hash_many(paths: list) -> list:
    """sha256 of each path, ``THREADS`` at a time."""
    if len(paths) <= 1 or THREADS == 1:
        return [sha256_file(p) for p in paths]
    with ThreadPoolExecutor(min(THREADS, len(paths))) as pool:
        return list(pool.map(sha256_file, paths))


def _read_stamps(root: Path) -> dict:
    try:
        stamps = json.loads((root / STAMPS).read_text())
        return stamps if isinstance(stamps, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_stamps(root: Path, stamps: dict) -> None:
    """Best effort: a read-only checkpoint (another run's --load folder) is simply re-hashed."""
    try:
        tmp = root / (STAMPS + ".tmp")
        tmp.write_text(json.dumps(dict(sorted(stamps.items()))) + "\n")
        tmp.replace(root / STAMPS)
    except OSError:
        pass


def _dist():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist, dist.get_rank(), dist.get_world_size()
    return None, 0, 1


def _gather(obj, dist, world: int) -> list:
    if dist is None:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def hash_files(root) -> dict:
    """Each file under ``root``: {name: {"size", "sha256", "stamp"}}, on every rank (collective
    when a process group exists; each rank takes its share). A digest recorded as the file was
    written (``hashing.recorded_sha256``) stands for hashing it; the others are read and hashed.
    Removes the digest records, so none is left in the checkpoint."""
    root = Path(root)
    dist, rank, world = _dist()
    names = [n for i, n in enumerate(_files(root)) if i % world == rank]
    mine, to_hash = {}, []
    for name in names:
        stat = (root / name).stat()
        stamp = [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]
        sha = recorded_sha256(root / name, stat)
        if sha is None:
            to_hash.append((name, stamp))
        else:
            mine[name] = {"size": stamp[0], "sha256": sha, "stamp": stamp}
    for (name, stamp), sha in zip(to_hash, _hash_many([root / n for n, _ in to_hash])):
        mine[name] = {"size": stamp[0], "sha256": sha, "stamp": stamp}
    for name in names:
        record_path(root / name).unlink(missing_ok=True)
    files = {}
    for part in _gather(mine, dist, world):
        files.update(part)
    if rank == 0:  # records of files no rank listed (an orphan: its file is gone)
        for stray in list(root.rglob("*" + RECORD_SUFFIX)):
            stray.unlink(missing_ok=True)
    return files


def write_manifest(root, *, files: Optional[dict] = None,
                   written: Optional[dict] = None) -> dict:
    """Write ``manifest.json`` (rank 0) with every file of ``root`` and its .verified.json stamps.

    ``files``: ``hash_files(root)`` already taken (by default it is taken here: collective).
    ``written`` ({name: bytes}, rank 0's): files rank 0 writes into ``root`` now, hashed from
    memory (the checkpoint's state.json, which records how long the save took up to here).
    Returns the manifest (rank 0's has ``written`` too)."""
    root = Path(root)
    _, rank, _ = _dist()
    files = dict(hash_files(root) if files is None else files)
    if rank == 0:
        for name, data in (written or {}).items():
            (root / name).write_bytes(data)
            files[name] = {"size": len(data), "sha256": sha256_bytes(data),
                           "stamp": _stamp(root / name)}
    manifest = {"format": FORMAT, "files": {n: {"size": e["size"], "sha256": e["sha256"]}
                                            for n, e in sorted(files.items())}}
    if rank == 0:
        _write_stamps(root, {n: {"stamp": e["stamp"], "sha256": e["sha256"]}
                             for n, e in files.items()})
        tmp = root / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=1) + "\n")
        tmp.replace(root / MANIFEST)
    return manifest


def read_checkpoint_manifest(root) -> Optional[dict]:
    """The manifest, None if the checkpoint has none; CheckpointDamaged if it is unreadable."""
    path = Path(root) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        assert isinstance(files, dict)
    except (ValueError, KeyError, AssertionError, UnicodeDecodeError) as err:
        raise CheckpointDamaged(f"{path} is unreadable ({type(err).__name__})") from err
    return manifest


def _check_size(root: Path, name: str, entry: dict) -> Optional[str]:
    path = root / name
    if not path.is_file():
        return f"{path} is missing"
    size = path.stat().st_size
    if size != entry["size"]:
        return f"{path} has {size} bytes, the manifest says {entry['size']} (truncated or rewritten)"
    return None


def verify(root, *, trust_stamps: bool = False, record: bool = True,
           stats: Optional[dict] = None) -> list:
    """Problems found in checkpoint ``root`` (empty: it verifies). Collective when a process
    group exists: each rank checks its share of the files, every rank gets all problems.

    Sizes always; sha256s of every file, or with ``trust_stamps`` (resume) only of files whose
    size, mtime or ctime changed since they were last hashed (``STAMPS``; updated unless not
    ``record``: a checkpoint folder of another run is read, never written).
    ``stats``, if given, receives files / hashed / bytes_hashed / seconds (summed over ranks).
    """
    root = Path(root)
    start = time.perf_counter()
    dist, rank, world = _dist()
    problems, checked = [], {}
    try:
        manifest = read_checkpoint_manifest(root)
    except CheckpointDamaged as err:
        manifest, problems = None, [str(err)]
    if manifest is None and not problems:
        problems = [f"{root} has no {MANIFEST} (incomplete, or written by a version without "
                    f"manifests)"]
    entries = sorted(manifest["files"].items()) if manifest is not None else []
    entries = [(n, e) for i, (n, e) in enumerate(entries) if i % world == rank]
    known = _read_stamps(root) if trust_stamps else {}
    to_hash = []
    for name, entry in entries:
        problem = _check_size(root, name, entry)
        if problem is not None:
            problems.append(problem)
            continue
        stamp, seen = _stamp(root / name), known.get(name, {})
        if seen.get("stamp") == stamp and seen.get("sha256") == entry["sha256"]:
            checked[name] = seen
        else:
            to_hash.append((name, entry, stamp))
    for (name, entry, stamp), sha in zip(to_hash, _hash_many([root / n for n, _, _ in to_hash])):
        if sha != entry["sha256"]:
            problems.append(f"{root / name} does not match its sha256 in the manifest (corrupted)")
        else:
            checked[name] = {"stamp": stamp, "sha256": sha}
    mine = (problems, checked if trust_stamps and record and to_hash else {},
            [len(entries), len(to_hash), sum(e["size"] for _, e, _ in to_hash)])
    merged, stamps, counts = [], {}, [0, 0, 0]
    for part_problems, part_stamps, part_counts in _gather(mine, dist, world):
        merged.extend(p for p in part_problems if p not in merged)
        stamps.update(part_stamps)
        counts = [a + b for a, b in zip(counts, part_counts)]
    if rank == 0 and stamps:
        _write_stamps(root, {**known, **stamps})
    if stats is not None:
        stats.update(files=counts[0], hashed=counts[1], bytes_hashed=counts[2],
                     seconds=time.perf_counter() - start)
    return merged


_verify = verify  # NOTE: require_verified's flag ``verify`` hides the function there


def _legacy(root: Path) -> bool:
    """Written before checkpoints carried a manifest: no manifest.json, and per-rank optimizer
    files (format 1) or a state.json that records no format of ``MANIFESTS_SINCE`` or later (a
    format-1 checkpoint, an import of that time, one written by hand). A checkpoint of a later
    format without its manifest is incomplete, not old."""
    if (root / MANIFEST).exists():
        return False
    if (root / "optim_rank0.pt").is_file():
        return True
    try:
        state = read_state(root)
        return int(state.get("format", 1)) < MANIFESTS_SINCE
    except (OSError, ValueError, TypeError, AttributeError):
        return False


def require_verified(step_dir, *, verify: bool = True, what: str,
                     log: Optional[Callable] = print) -> None:
    """Refuse checkpoint ``step_dir`` unless every file matches its manifest: call it before a
    reader loads or writes anything. ``what`` names the reader in the message ("--load-weights").

    Raises ``CheckpointDamaged`` naming the checkpoint, every missing, truncated or corrupted file
    and the ways on. A checkpoint written before manifests is read with a note; ``verify=False``
    (``--no-verify``) reads it unchecked with a warning. Hashes every file (as resume does);
    collective when a process group exists, and only rank 0 prints.
    """
    root = Path(step_dir)
    _, rank, _ = _dist()
    say = log if (log is not None and rank == 0) else (lambda *_: None)
    if not verify:
        say(f"WARNING: --no-verify: reading {root} without checking its files")
        return
    if _legacy(root):
        say(f"note: {root} has no {MANIFEST} (written before checkpoints carried one): {what} "
            f"reads it unchecked")
        return
    problems = _verify(root)
    if problems:
        raise CheckpointDamaged(
            f"checkpoint {root} is damaged, so {what} refused it (nothing loaded or written): "
            f"{'; '.join(problems)}; restore these files from a good copy, use another "
            f"checkpoint, or pass --no-verify to read it anyway")
