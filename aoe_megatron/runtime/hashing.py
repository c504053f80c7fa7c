"""sha256 of files, read back or taken as they are written: the one hashing code of checkpoint
manifests (``checkpoint/integrity.py``) and corpus manifests (``data/integrity.py``).

``HashingWriter`` hashes what goes through a binary file's ``write``, so a file needs no second
read to be hashed. Given a path to record to (``open_recorded``), it leaves a digest record next to
the file when it closes: ``NAME`` + ``RECORD_SUFFIX``, holding the file's size, sha256 and mtime.
A record is what a writer in another process (megatron-core's checkpoint writers are forked
children in 0.16.1) hands to the manifest; ``recorded_sha256`` trusts it only while the file's
size and mtime are still those recorded, and never a writer that seeked, truncated or left the
file's position anywhere but after the bytes it hashed (the digest would not be the file's).

Imports nothing of the package: the patches use it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Optional

CHUNK = 8 << 20
RECORD_SUFFIX = ".sha256.json"
"""A digest record's name: the file's name plus this. Never part of a checkpoint's manifest."""


def sha256_file(path, progress: Optional[Callable[[int], None]] = None) -> str:
    """The file's sha256, read in chunks; ``progress(n)`` after each chunk of n bytes, if given."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            if progress is not None:
                progress(len(chunk))
    return digest.hexdigest()


def sha256_bytes(data) -> str:
    """The sha256 of bytes in memory (a file about to be written)."""
    return hashlib.sha256(data).hexdigest()


class HashingWriter:
    """A binary file opened for writing that hashes and counts the bytes it writes.

    ``valid`` turns False for good if anything could make the digest differ from the file's:
    a seek away from the end, a truncate, a short write, or (checked at close) a file position
    other than the bytes hashed (something wrote through the file descriptor). ``record_to``: the
    file's path; a valid writer then leaves its digest record beside it when it closes without an
    exception (``open_recorded``). Other attributes (``fileno``, ``flush``, ``tell``, ...) are the
    file's own.
    """

    def __init__(self, file, *, record_to=None):
        self._file, self._record_to = file, record_to
        self._sha, self.size, self.valid = hashlib.sha256(), 0, True

    def write(self, data) -> int:
        view = memoryview(data)
        written = self._file.write(view)
        if written is None or written != view.nbytes:  # a raw file's short write: not hashed
            self.valid = False
        elif self.valid:
            self._sha.update(view)
            self.size += written
        return written

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        position = self._file.seek(offset, whence)
        if position != self.size:  # NOTE: a later write would overwrite or leave a hole
            self.valid = False
        return position

    def truncate(self, size=None) -> int:
        self.valid = False
        return self._file.truncate(size)

    def hexdigest(self) -> Optional[str]:
        """The sha256 of the bytes written; None if ``valid`` is False."""
        return self._sha.hexdigest() if self.valid else None

    def close(self) -> None:
        if self._file.closed:
            return
        try:
            if self.valid and self._file.tell() != self.size:
                self.valid = False
        except OSError:  # not seekable: a pipe, a socket
            self.valid = False
        self._file.close()
        if self._record_to is not None and self.valid:
            _write_record(Path(self._record_to), self.size, self._sha.hexdigest())

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:  # a failed write leaves no record
            self.valid = False
        self.close()

    def __getattr__(self, name):
        if name == "_file":  # not yet set (a copy, an unpickling): no recursion
            raise AttributeError(name)
        return getattr(self._file, name)


def open_recorded(path, mode: str = "wb") -> HashingWriter:
    """``open(path, "wb")`` whose digest is recorded next to the file when it closes."""
    if mode not in ("wb", "bw"):
        raise ValueError(f"open_recorded writes a new binary file (mode 'wb'), not {mode!r}")
    return HashingWriter(open(path, mode), record_to=path)


def record_path(path) -> Path:
    path = Path(path)
    return path.with_name(path.name + RECORD_SUFFIX)


def is_record(path) -> bool:
    return str(path).endswith(RECORD_SUFFIX)


def _write_record(path: Path, size: int, sha256: str) -> None:
    stat = path.stat()  # after close: the file as readers will find it
    if stat.st_size != size:
        return
    record = {"size": size, "sha256": sha256, "mtime_ns": stat.st_mtime_ns}
    record_path(path).write_text(json.dumps(record) + "\n")


def recorded_sha256(path, stat: Optional[os.stat_result] = None) -> Optional[str]:
    """The sha256 recorded while ``path`` was written, if its size and mtime are still those
    recorded; else None (no record, an unreadable one, or the file changed since)."""
    try:
        record = json.loads(record_path(path).read_text())
        stat = stat or Path(path).stat()
        if record["size"] == stat.st_size and record["mtime_ns"] == stat.st_mtime_ns:
            return str(record["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None
