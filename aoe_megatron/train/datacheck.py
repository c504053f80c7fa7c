"""The data a run trains on, recorded in every checkpoint and compared when the run resumes.

The fingerprint of a ``--data`` run lists every dataset of the data config, in its order:
  role, prefix, weight                    where it is in the blend (``split`` too, once)
  tokenizer_sha256, documents, tokens     from the dataset's preprocessing manifest
  sources_sha256                          sha256 over the manifest's hashes of the source files
  bin_bytes, idx_bytes                    the sizes of the .bin and .idx files
  bin_sample_sha256, idx_sample_sha256    sha256 of a file's size and three 1 MiB samples
                                          (start, middle, end)
A ``--mock-data`` run's fingerprint is ``"mock"``.

NOTE: whole-file hashes of the .bin files would read the entire corpus (terabytes) at every
resume. Preprocessing already hashed what was tokenized (the sources) and writes the manifest
with its .bin/.idx; sizes and sampled hashes (imohash's idea) catch files replaced or truncated
since, at a constant cost: the manifests plus 6 MiB per dataset.

A resume compares every field but the prefix (moved data is the same data) and refuses any
difference, showing both values, unless ``--allow-data-change``: then it warns with both values,
and the checkpoints that follow record the new fingerprint.
"""

from __future__ import annotations

import hashlib
import os
from typing import Optional, Union

from aoe_megatron.data.config import DataConfig
from aoe_megatron.data.manifest import read_manifest
from aoe_megatron.train import console
from aoe_megatron.train.errors import TrainingHalted

MOCK = "mock"
SAMPLE_BYTES = 1 << 20
COMPARED = ("weight", "tokenizer_sha256", "documents", "tokens", "sources_sha256", "bin_bytes",
            "idx_bytes", "bin_sample_sha256", "idx_sample_sha256")

Fingerprint = Union[str, dict]


class DataChanged(TrainingHalted):
    """The data differs from the checkpoint's record and ``--allow-data-change`` is not given."""


def sample_sha256(path: str, sample: int = SAMPLE_BYTES) -> str:
    """sha256 of the file's size and of ``sample`` bytes at its start, middle and end (the whole
    file when it is at most three samples long)."""
    size = os.path.getsize(path)
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as fh:
        if size <= 3 * sample:
            digest.update(fh.read())
        else:
            for offset in (0, (size - sample) // 2, size - sample):
                fh.seek(offset)
                digest.update(fh.read(sample))
    return digest.hexdigest()


def dataset_fingerprint(prefix: str, manifest: Optional[dict] = None) -> dict:
    """``manifest``: the dataset's preprocessing manifest when already read."""
    manifest = read_manifest(prefix) if manifest is None else manifest
    sources = hashlib.sha256("\n".join(s["sha256"] for s in manifest.get("sources", [])).encode())
    return {
        "tokenizer_sha256": manifest["tokenizer"]["sha256"],
        "documents": manifest["documents"],
        "tokens": manifest["tokens"],
        "sources_sha256": sources.hexdigest(),
        "bin_bytes": os.path.getsize(f"{prefix}.bin"),
        "idx_bytes": os.path.getsize(f"{prefix}.idx"),
        "bin_sample_sha256": sample_sha256(f"{prefix}.bin"),
        "idx_sample_sha256": sample_sha256(f"{prefix}.idx"),
    }


def fingerprint(data, manifests: Optional[dict] = None) -> Fingerprint:
    """The fingerprint of the data config ``data`` (a ``DataConfig``, path or dict); None:
    ``"mock"``. ``manifests``: {prefix: manifest} when already read (a resolved run's)."""
    if data is None:
        return MOCK

    cfg = data if isinstance(data, DataConfig) else DataConfig.load(data)
    manifests = manifests or {}
    weights = [*cfg.weights, *cfg.valid_weights, *cfg.test_weights]
    roles = cfg.roles()
    return {"split": cfg.split, "datasets": [
        {"role": role, "prefix": prefix, "weight": weight,
         **dataset_fingerprint(prefix, manifests.get(prefix))}
        for role, prefix, weight in zip(roles, cfg.prefixes, weights)]}


def agreed_fingerprint(data, manifests: Optional[dict] = None) -> Fingerprint:
    """Rank 0's fingerprint on every rank (one reader; every rank then judges alike)."""
    import torch.distributed as dist

    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = fingerprint(data, manifests)
        except (OSError, ValueError, KeyError) as err:  # every rank must learn of it, or hang
            where = ", ".join(getattr(data, "prefixes", ())) or data
            box[0] = DataChanged(f"cannot fingerprint the data of {where}: {err}")
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def _describe(fp: Fingerprint) -> str:
    if fp == MOCK:
        return "mock data (random tokens)"
    return ", ".join(f"{d['role']} {d['prefix']}" for d in fp["datasets"])


def differences(recorded: Fingerprint, current: Fingerprint) -> list:
    """One line per difference, ``where: field: recorded (checkpoint) vs current (now)``."""
    if recorded == MOCK or current == MOCK or len(recorded["datasets"]) != len(current["datasets"]):
        if recorded == current:
            return []
        return [f"datasets: {_describe(recorded)} (checkpoint) vs {_describe(current)} (now)"]
    lines = []
    if recorded["split"] != current["split"]:
        lines.append(f"split: {recorded['split']} (checkpoint) vs {current['split']} (now)")
    for then, now in zip(recorded["datasets"], current["datasets"]):
        where = f"{now['role']} {now['prefix']}"
        if then["prefix"] != now["prefix"] or then["role"] != now["role"]:
            where += f" (was {then['role']} {then['prefix']})"
        lines += [f"{where}: {key}: {then.get(key)} (checkpoint) vs {now.get(key)} (now)"
                  for key in COMPARED if then.get(key) != now.get(key)]
    return lines


def check_resume(recorded: Optional[Fingerprint], current: Fingerprint, *, checkpoint,
                 allow: bool, announce: bool) -> list:
    """Refuse (``DataChanged``) to resume from ``checkpoint`` on data other than its record;
    with ``allow``, warn instead (printed when ``announce``). Returns the differences.
    A checkpoint written before fingerprints were recorded (``recorded`` None) is not judged."""
    if recorded is None:
        if announce:
            console.say(f"note: {checkpoint} records no data fingerprint; recording one from now "
                        f"on")
        return []
    lines = differences(recorded, current)
    if not lines:
        return []
    listing = "\n".join(f"  {line}" for line in lines)
    if not allow:
        raise DataChanged(
            f"the data differs from what {checkpoint} was trained on:\n{listing}\n"
            f"Resuming would continue the run on other data. Restore the data, or pass "
            f"--allow-data-change to resume anyway (the new data is then recorded in the "
            f"following checkpoints).")
    if announce:
        console.say(f"WARNING: --allow-data-change: resuming from {checkpoint} on data that "
                    f"differs from its record:\n{listing}\nthe following checkpoints record the "
                    f"new data")
    return lines
