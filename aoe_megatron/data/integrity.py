"""Corpus integrity: is a preprocessed dataset (``PREFIX.bin`` + ``PREFIX.idx``) the one its
manifest describes?

Two levels of checking:
- ``check_datasets``, run by every training launch before any process group starts (and by
  every dataset build): both files exist, their sizes are those the manifest recorded, and the
  ``.idx`` header agrees with the ``.bin`` (megatron's magic and version, the token dtype, the
  index size its counts imply, and the last sequence ending exactly at the end of the ``.bin``).
  It reads only a few bytes of each file, so it costs nothing even for terabytes.
- ``verify_dataset`` (the ``aoe-verify-data`` command, meant for use after a copy) also hashes
  both files against the sha256s recorded while preprocessing wrote them.

Manifests from before these fields (no ``files`` entry) still load. The ``.idx`` is still
checked against the ``.bin``, and a one-line note says that the sizes and hashes were not
recorded.
"""

from __future__ import annotations

import os
import struct
import sys
from dataclasses import dataclass
from typing import Callable, Optional

from aoe_megatron.runtime.hashing import HashingWriter, sha256_file

#: megatron-core's index format (megatron/core/datasets/indexed_dataset.py, 0.16.1): magic,
#: version <Q, dtype code <B, sequence count <Q, document count <Q, then int32 lengths, int64
#: pointers and int64 document indices.
IDX_MAGIC = b"MMIDIDX\x00\x00"
IDX_HEADER = struct.Struct("<9sQBQQ")
#: megatron's DType codes -> bytes per token.
DTYPE_BYTES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}
DTYPE_NAMES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64",
               7: "float32", 8: "uint16"}


class CorpusDamaged(ValueError):
    """A dataset's files are not those its manifest describes."""


def file_record(path: str, *, writer: Optional[HashingWriter] = None,
                progress: Optional[Callable[[int], None]] = None) -> dict:
    """{"size", "sha256"} of a file just written: from ``writer`` when it hashed the writes (the
    ``.bin`` is hashed as preprocessing writes it, not in a second pass), else read back;
    ``progress(n)`` after each chunk hashed."""
    if writer is not None and writer.valid:
        return {"size": writer.size, "sha256": writer.hexdigest()}
    return {"size": os.path.getsize(path), "sha256": sha256_file(path, progress)}


@dataclass(frozen=True)
class IdxHeader:
    """A megatron-core ``.idx`` header: the counts that say where its three arrays lie."""

    path: str
    size: int
    """Bytes of the ``.idx`` file."""
    code: int
    """megatron's DType code of the tokens (``DTYPE_NAMES``, ``DTYPE_BYTES``)."""
    sequences: int
    boundaries: int
    """Entries of the document index: sequence indices from 0 to ``sequences``, one more than
    the documents."""

    @property
    def dtype(self) -> str:
        return DTYPE_NAMES[self.code]

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.code]

    @property
    def lengths_offset(self) -> int:  # int32 tokens per sequence
        return IDX_HEADER.size

    @property
    def pointers_offset(self) -> int:  # int64 byte offset of each sequence in the .bin
        return IDX_HEADER.size + 4 * self.sequences

    @property
    def boundaries_offset(self) -> int:  # int64 sequence index where each document ends
        return IDX_HEADER.size + 12 * self.sequences


def read_idx_header(prefix: str) -> IdxHeader:
    """The header of ``PREFIX.idx``; ``CorpusDamaged`` if it is no megatron-core index."""
    idx = f"{prefix}.idx"
    idx_size = os.path.getsize(idx)
    if idx_size < IDX_HEADER.size:
        raise CorpusDamaged(f"{idx} has {idx_size} bytes: too short for an index header")
    with open(idx, "rb") as fh:
        magic, version, code, sequences, boundaries = IDX_HEADER.unpack(fh.read(IDX_HEADER.size))
    if magic != IDX_MAGIC or version != 1 or code not in DTYPE_BYTES:
        raise CorpusDamaged(f"{idx} is not a megatron-core index (header {magic!r}, version "
                            f"{version})")
    return IdxHeader(idx, idx_size, code, sequences, boundaries)


def structure_problems(prefix: str, header: IdxHeader, bin_size: int) -> list[str]:
    """The ``.idx``'s size against its header's counts, and its last sequence's end against the
    size of the ``.bin`` (reads 12 bytes)."""
    idx, sequences = header.path, header.sequences
    expected = IDX_HEADER.size + 12 * sequences + 8 * header.boundaries
    if header.size not in (expected, expected + sequences):  # + int8 modes (multimodal)
        return [f"{idx} has {header.size} bytes, its header ({sequences} sequences, "
                f"{header.boundaries} document boundaries) implies {expected}"]
    end = 0
    if sequences:
        with open(idx, "rb") as fh:
            fh.seek(header.lengths_offset + 4 * (sequences - 1))
            (last_length,) = struct.unpack("<i", fh.read(4))
            fh.seek(header.pointers_offset + 8 * (sequences - 1))
            (last_pointer,) = struct.unpack("<q", fh.read(8))
        end = last_pointer + last_length * header.itemsize
    if end != bin_size:
        return [f"{idx} indexes {end} bytes of tokens but {prefix}.bin has {bin_size}: the two "
                f"files are not one dataset"]
    return []


def _idx_problems(prefix: str, bin_size: int, manifest: dict) -> list[str]:
    try:
        header = read_idx_header(prefix)
    except CorpusDamaged as err:
        return [str(err)]
    problems = []
    if manifest.get("dtype") and header.dtype != manifest["dtype"]:
        problems.append(f"{header.path} says its tokens are {header.dtype}, the manifest says "
                        f"{manifest['dtype']}")
    return problems + structure_problems(prefix, header, bin_size)


def dataset_problems(prefix: str, manifest: dict) -> list[str]:
    """Sizes against the manifest and the ``.idx`` against the ``.bin`` (no hashing)."""
    missing = [f"{prefix}{ext} is missing" for ext in (".bin", ".idx")
               if not os.path.isfile(f"{prefix}{ext}")]
    if missing:
        return missing
    problems = []
    for ext, key in ((".bin", "bin"), (".idx", "idx")):
        recorded = (manifest.get("files") or {}).get(key)
        found = os.path.getsize(f"{prefix}{ext}")
        if recorded and found != recorded["size"]:
            problems.append(f"{prefix}{ext} has {found} bytes, the manifest says "
                            f"{recorded['size']} (an interrupted copy?)")
    return problems or _idx_problems(prefix, os.path.getsize(f"{prefix}.bin"), manifest)


def check_datasets(manifests: dict, *, say: Callable[[str], None] = None) -> None:
    """Raise ``CorpusDamaged`` naming every damaged file of ``manifests`` ({prefix: manifest});
    a manifest without recorded sizes gets a one-line note (``say``, default stderr)."""
    say = say or (lambda msg: print(msg, file=sys.stderr, flush=True))
    problems, old = [], []
    for prefix, manifest in manifests.items():
        problems += dataset_problems(prefix, manifest)
        if not manifest.get("files"):
            old.append(prefix)
    if old:
        say(f"note: {len(old)} dataset manifest(s) predate recorded sizes and hashes ({old[0]}"
            f"{', ...' if len(old) > 1 else ''}): checking each .idx against its .bin only; "
            f"preprocess again to record them")
    if problems:
        raise CorpusDamaged("the training data is damaged:\n  " + "\n  ".join(problems)
                            + "\nCopy the dataset again (then `aoe-verify-data` checks every "
                              "byte) or preprocess it again.")


def verify_dataset(prefix: str, manifest: dict,
                   progress: Optional[Callable[[int], None]] = None) -> list[str]:
    """``dataset_problems`` plus the sha256 of both files against the manifest's."""
    problems = dataset_problems(prefix, manifest)
    if problems:
        return problems
    for ext, key in ((".bin", "bin"), (".idx", "idx")):
        recorded = (manifest.get("files") or {}).get(key)
        if recorded is None:
            continue
        if sha256_file(f"{prefix}{ext}", progress) != recorded["sha256"]:
            problems.append(f"{prefix}{ext} does not match the sha256 its manifest recorded (same "
                            f"size, other content: another corpus, or damage)")
    return problems
