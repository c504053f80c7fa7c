"""Checkpoint manifests: every file of a checkpoint with its size and sha256.

``manifest.json`` is the last file written into a checkpoint before it is renamed into place.
Hashing and verification are split over the ranks (file i goes to rank i mod world size), so a
checkpoint of many shards is checked in parallel on a shared filesystem.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

MANIFEST = "manifest.json"
FORMAT = 1
_CHUNK = 8 << 20


class CorruptCheckpoint(Exception):
    """A checkpoint whose files do not match its manifest (or that has none)."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files(root: Path) -> list:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.is_file() and p.name != MANIFEST)


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


def write_manifest(root) -> dict:
    """Hash every file under ``root`` (collective when a process group exists); rank 0 writes
    ``manifest.json``. Returns the manifest on every rank."""
    root = Path(root)
    dist, rank, world = _dist()
    names = _files(root)
    mine = {n: {"size": (root / n).stat().st_size, "sha256": sha256_file(root / n)}
            for i, n in enumerate(names) if i % world == rank}
    files = {}
    for part in _gather(mine, dist, world):
        files.update(part)
    manifest = {"format": FORMAT, "files": dict(sorted(files.items()))}
    if rank == 0:
        tmp = root / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=1) + "\n")
        tmp.replace(root / MANIFEST)
    return manifest


def read_manifest(root) -> Optional[dict]:
    """The manifest, None if the checkpoint has none; CorruptCheckpoint if it is unreadable."""
    path = Path(root) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        assert isinstance(files, dict)
    except (ValueError, KeyError, AssertionError, UnicodeDecodeError) as err:
        raise CorruptCheckpoint(f"{path} is unreadable ({type(err).__name__})") from err
    return manifest


def _check_file(root: Path, name: str, entry: dict) -> Optional[str]:
    path = root / name
    if not path.is_file():
        return f"{path} is missing"
    size = path.stat().st_size
    if size != entry["size"]:
        return f"{path} has {size} bytes, the manifest says {entry['size']} (truncated or rewritten)"
    if sha256_file(path) != entry["sha256"]:
        return f"{path} does not match its sha256 in the manifest (corrupted)"
    return None


def verify(root) -> list:
    """Problems found in checkpoint ``root`` (empty: it verifies). Collective when a process
    group exists: each rank hashes its share of the files, every rank gets all problems."""
    root = Path(root)
    dist, rank, world = _dist()
    problems = []
    try:
        manifest = read_manifest(root)
    except CorruptCheckpoint as err:
        manifest, problems = None, [str(err)]
    if manifest is None and not problems:
        problems = [f"{root} has no {MANIFEST} (incomplete, or written by a version without "
                    f"manifests)"]
    if manifest is not None:
        entries = sorted(manifest["files"].items())
        problems = [p for i, (name, entry) in enumerate(entries) if i % world == rank
                    if (p := _check_file(root, name, entry)) is not None]
    merged = []
    for part in _gather(problems, dist, world):
        merged.extend(p for p in part if p not in merged)
    return merged
