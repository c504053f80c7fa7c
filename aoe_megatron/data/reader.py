"""Streaming line readers for .jsonl, .jsonl.gz and .jsonl.zst, hashing the raw bytes as they go.

A truncated compressed stream is reported (``TruncatedStream``) after the lines that could be
recovered, so the caller can count it and keep going with the next file.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import zlib
from typing import BinaryIO, Iterator

READ_SIZE = 1 << 20


class TruncatedStream(Exception):
    """The compressed stream ended before its end-of-stream marker."""


class _HashingReader(io.RawIOBase):
    """Wraps a binary file; every byte read updates ``sha256`` and ``bytes_read``."""

    def __init__(self, raw: BinaryIO):
        self.raw = raw
        self.sha256 = hashlib.sha256()
        self.bytes_read = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self.raw.readinto(buffer)
        if n:
            self.sha256.update(memoryview(buffer)[:n])
            self.bytes_read += n
        return n or 0

    def drain(self) -> None:
        """Read (and hash) whatever is left, so the digest covers the whole file."""
        while self.read(READ_SIZE):
            pass


def _lines_from_chunks(chunks: Iterator[bytes]) -> Iterator[bytes]:
    tail = b""
    for chunk in chunks:
        if not chunk:
            continue
        parts = (tail + chunk).split(b"\n")
        tail = parts.pop()
        yield from parts
    if tail:
        yield tail


def _zstd_chunks(src: io.RawIOBase) -> Iterator[bytes]:
    import zstandard

    dctx = zstandard.ZstdDecompressor()
    dobj, pending = dctx.decompressobj(), False
    while True:
        raw = src.read(READ_SIZE)
        if not raw:
            break
        while raw:
            pending = True
            yield dobj.decompress(raw)
            if dobj.eof:  # one frame done; the rest of ``raw`` starts the next frame
                raw, dobj, pending = dobj.unused_data, dctx.decompressobj(), False
            else:
                raw = b""
    if pending:
        raise TruncatedStream("zstd stream ended inside a frame")


def _gzip_chunks(src: io.RawIOBase) -> Iterator[bytes]:
    with gzip.GzipFile(fileobj=src) as gz:
        while True:
            try:
                chunk = gz.read(READ_SIZE)
            except (EOFError, zlib.error, gzip.BadGzipFile) as err:
                raise TruncatedStream(f"gzip stream is truncated or corrupt: {err}") from None
            if not chunk:
                return
            yield chunk


class SourceFile:
    """One input file: iterate its lines (bytes, without the newline), then read size/sha256."""

    def __init__(self, path: str):
        self.path = str(path)
        self.size = 0
        self.sha256 = ""

    def lines(self) -> Iterator[bytes]:
        with open(self.path, "rb") as fh:
            src = _HashingReader(fh)
            try:
                if self.path.endswith(".gz"):
                    chunks = _gzip_chunks(src)
                elif self.path.endswith(".zst"):
                    chunks = _zstd_chunks(src)
                else:
                    chunks = iter(lambda: src.read(READ_SIZE), b"")
                yield from _lines_from_chunks(chunks)
            finally:
                src.drain()
                self.size, self.sha256 = src.bytes_read, src.sha256.hexdigest()


SUPPORTED_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json", ".json.gz", ".json.zst")
