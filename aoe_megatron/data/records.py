"""Turning JSONL lines into token ids, or into a counted rejection (runs in worker processes).

Reasons a record is rejected (each counted, with its first line numbers reported):
    invalid_utf8      the line (or a JSON string escape in it) is not valid UTF-8
    invalid_json      the line is not JSON, or not a JSON object
    missing_field     a --json-keys field is absent
    non_string_field  a --json-keys field is not a string
    empty_text        a --json-keys field is empty or whitespace only
A truncated .gz / .zst stream is counted as ``truncated_stream`` by the reader.
Blank lines are skipped and counted, not rejected.
"""

from __future__ import annotations

import json
from itertools import chain
from dataclasses import dataclass, field

import numpy as np

REASONS = ("invalid_utf8", "invalid_json", "missing_field", "non_string_field", "empty_text",
           "truncated_stream")


@dataclass
class ChunkResult:
    """What a worker returns for one chunk of lines (ids concatenated per key)."""

    ids: dict  # key -> np.ndarray of all documents' ids, concatenated
    lengths: dict  # key -> np.ndarray of per-document lengths
    rejected: list = field(default_factory=list)  # (reason, line number)
    documents: int = 0
    blank_lines: int = 0
    bytes: int = 0


def _check(line: bytes, keys) -> tuple[str | None, list[str]]:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        return "invalid_utf8", []
    try:
        record = json.loads(text)
    except ValueError:
        return "invalid_json", []
    if not isinstance(record, dict):
        return "invalid_json", []
    values = []
    for key in keys:
        if key not in record:
            return "missing_field", []
        value = record[key]
        if not isinstance(value, str):
            return "non_string_field", []
        if not value.strip():
            return "empty_text", []
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates from JSON escapes
            return "invalid_utf8", []
        values.append(value)
    return None, values


class RecordEncoder:
    """Validates and tokenizes chunks of lines; one per worker process."""

    def __init__(self, tokenizer, keys, *, prepend_bos: bool, append_eod: bool, dtype):
        self.tokenizer = tokenizer
        self.keys = tuple(keys)
        self.prepend_bos = prepend_bos
        self.append_eod = append_eod
        self.dtype = dtype

    def encode_chunk(self, first_line: int, lines: list[bytes]) -> ChunkResult:
        rejected, texts, blank, nbytes = [], [[] for _ in self.keys], 0, 0
        for offset, line in enumerate(lines):
            nbytes += len(line) + 1
            if not line.strip():
                blank += 1
                continue
            reason, values = _check(line, self.keys)
            if reason:
                rejected.append((reason, first_line + offset))
                continue
            for bucket, value in zip(texts, values):
                bucket.append(value)
        ids, lengths = {}, {}
        for key, bucket in zip(self.keys, texts):
            docs = self.tokenizer.encode(bucket)
            if self.prepend_bos:
                docs = [[self.tokenizer.bos_id] + d for d in docs]
            if self.append_eod:
                docs = [d + [self.tokenizer.eos_id] for d in docs]
            lengths[key] = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
            total = int(lengths[key].sum())
            ids[key] = np.fromiter(chain.from_iterable(docs), dtype=self.dtype, count=total)
        return ChunkResult(ids, lengths, rejected, len(texts[0]) if texts else 0, blank, nbytes)
