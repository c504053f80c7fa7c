"""Adopting corpora tokenized by Megatron-LM: its ``tools/preprocess_data.py`` writes
``PREFIX.bin``/``PREFIX.idx`` with megatron-core's ``IndexedDatasetBuilder`` but no manifest, which
training requires. ``adopt`` (``aoe-verify-data --adopt``) checks such a pair and writes the
manifest aoe-preprocess would have written; ``unadopted_manifest`` (training's ``--no-manifest``)
builds it in memory without hashing.

Megatron's index (megatron/core/datasets/indexed_dataset.py): after the header, int32 tokens per
sequence, int64 byte offset of each sequence in the ``.bin``, and the int64 document index: the
sequence indices where documents end, from 0 to the sequence count (one entry more than the
documents). A document is one sequence, or one per sentence with ``--split-sentences``; a
document empty after tokenizing has no sequence at all.

What is checked reads the whole ``.idx`` (about 20 bytes per document) but only a bounded sample
of the ``.bin``: the first and last tokens of up to ``DOCUMENT_SAMPLE`` evenly spaced documents
(EOD and BOS), and ``TOKEN_SAMPLE_BYTES`` of tokens in evenly spaced windows (the vocabulary).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import datetime, timezone
from typing import Callable, Optional

import numpy as np

from aoe_megatron.data.integrity import (CorpusDamaged, file_record, read_idx_header,
                                         structure_problems)
from aoe_megatron.data.manifest import MANIFEST_VERSION
from aoe_megatron.data.tokenizer import Tokenizer

DOCUMENT_SAMPLE = 10_000
"""Documents whose first and last tokens are read (all of them in a smaller corpus)."""
TOKEN_SAMPLE_BYTES = 4 << 20
"""Bytes of tokens read for the vocabulary check, in ``TOKEN_WINDOWS`` evenly spaced windows."""
TOKEN_WINDOWS = 64
ALL, NONE, MIXED = "all sampled", "none", "mixed"
_CHUNK = 1 << 24  # sequence lengths summed at a time


def _finding(found: int, sampled: int) -> str:
    return ALL if sampled and found == sampled else NONE if found == 0 else MIXED


def _token_sample(tokens: np.ndarray) -> np.ndarray:
    """Up to ``TOKEN_SAMPLE_BYTES`` of ``tokens`` (a memmap) in evenly spaced windows."""
    budget = TOKEN_SAMPLE_BYTES // tokens.itemsize
    if len(tokens) <= budget:
        return np.asarray(tokens)
    width = budget // TOKEN_WINDOWS
    starts = np.linspace(0, len(tokens) - width, TOKEN_WINDOWS).astype(np.int64)
    return np.concatenate([np.asarray(tokens[s: s + width]) for s in starts])


def inspect_corpus(prefix: str, tokenizer: Tokenizer) -> dict:
    """What a manifest needs from the megatron-core dataset ``prefix`` tokenized by ``tokenizer``.

    Raises ``CorpusDamaged`` (a ValueError) when the pair is not one dataset: a missing file, an
    ``.idx`` whose header, size or document index is not megatron-core's, or whose last sequence
    does not end at the end of the ``.bin``. Otherwise returns (JSON-ready)
    ``{"dtype", "sequences", "documents", "tokens", "last_document_inside_bin": True,
    "vocab": {"vocab_size", "sampled_tokens", "min_id", "max_id", "within"},
    "eod": {"id", "sampled", "found", "finding"}, "bos": {...the same}, "empty_documents"}``,
    where ``finding`` is ``"all sampled"``, ``"none"`` or ``"mixed"`` over the sampled documents
    that hold a token (``empty_documents`` counts the sampled ones that hold none).
    """
    missing = [f"{prefix}{ext} is missing" for ext in (".bin", ".idx")
               if not os.path.isfile(f"{prefix}{ext}")]
    if missing:
        raise CorpusDamaged("; ".join(missing))
    header = read_idx_header(prefix)
    bin_size = os.path.getsize(f"{prefix}.bin")
    problems = structure_problems(prefix, header, bin_size)
    if header.code in (6, 7):
        problems.append(f"{header.path} says its tokens are {header.dtype}: not token ids")
    if header.boundaries < 1:
        problems.append(f"{header.path} has no document index")
    if problems:
        raise CorpusDamaged("; ".join(problems))
    seqs, idx = header.sequences, header.path
    if seqs == 0:
        raise CorpusDamaged(f"{idx} indexes no tokens")
    lengths = np.memmap(idx, np.int32, "r", header.lengths_offset, (seqs,))
    pointers = np.memmap(idx, np.int64, "r", header.pointers_offset, (seqs,))
    bounds = np.memmap(idx, np.int64, "r", header.boundaries_offset, (header.boundaries,))
    tokens, shortest = 0, 0
    for start in range(0, seqs, _CHUNK):
        part = np.asarray(lengths[start: start + _CHUNK])
        tokens += int(part.sum(dtype=np.int64))
        shortest = min(shortest, int(part.min()))
    if shortest < 0 or bounds[0] != 0 or bounds[-1] != seqs:
        raise CorpusDamaged(f"{idx} is not a megatron-core index: negative sequence lengths or a "
                            f"document index that does not run from 0 to {seqs} sequences")

    # the first and last token of evenly spaced documents (a document spans sequences
    # bounds[k] .. bounds[k+1]-1; the .bin holds sequences back to back)
    documents = header.boundaries - 1
    chosen = np.unique(np.linspace(0, max(documents - 1, 0), min(documents, DOCUMENT_SAMPLE))
                       .round().astype(np.int64))
    first, end = np.asarray(bounds[chosen]), np.asarray(bounds[chosen + 1])
    if np.any(first > end) or np.any(end > seqs):
        raise CorpusDamaged(f"{idx}'s document index is not in order: not a megatron-core index")
    has_seq = end > first
    first, last = first[has_seq], end[has_seq] - 1
    size = header.itemsize
    begin = np.asarray(pointers[first])
    stop = np.asarray(pointers[last]) + np.asarray(lengths[last]).astype(np.int64) * size
    if np.any(begin % size) or np.any(begin < 0) or np.any(stop > bin_size) or np.any(begin > stop):
        raise CorpusDamaged(f"{idx} points outside {prefix}.bin: the two files are not one dataset")
    full = stop > begin
    begin, stop = begin[full] // size, stop[full] // size
    data = np.memmap(f"{prefix}.bin", np.dtype(header.dtype), "r", 0, (bin_size // size,))
    heads, tails = np.asarray(data[begin]), np.asarray(data[stop - 1])
    sampled = len(begin)

    ids = np.concatenate([_token_sample(data), heads, tails]).astype(np.int64)
    low, high = int(ids.min()), int(ids.max())
    eod_found = int((tails == tokenizer.eos_id).sum())
    bos_found = int((heads == tokenizer.bos_id).sum()) if tokenizer.bos_id >= 0 else 0
    return {
        "dtype": header.dtype, "sequences": seqs, "documents": documents, "tokens": tokens,
        "last_document_inside_bin": True,
        "vocab": {"vocab_size": tokenizer.vocab_size, "sampled_tokens": int(ids.size),
                  "min_id": low, "max_id": high,
                  "within": low >= 0 and high < tokenizer.vocab_size},
        "eod": {"id": tokenizer.eos_id, "sampled": sampled, "found": eod_found,
                "finding": _finding(eod_found, sampled)},
        "bos": {"id": tokenizer.bos_id, "sampled": sampled, "found": bos_found,
                "finding": _finding(bos_found, sampled)},
        "empty_documents": len(chosen) - sampled,
    }


def _judge(prefix: str, checks: dict, tokenizer: Tokenizer) -> None:
    """Refuse (ValueError) a corpus whose manifest could not describe it truthfully."""
    vocab = checks["vocab"]
    if not vocab["within"]:
        raise ValueError(
            f"{prefix} holds token ids {vocab['min_id']}..{vocab['max_id']}, outside the "
            f"{vocab['vocab_size']} ids of tokenizer {tokenizer.path}: tokenized with another "
            f"tokenizer? Pass the one it was tokenized with (--tokenizer-model)")
    if checks["eod"]["sampled"] == 0:
        raise ValueError(f"{prefix}: none of the sampled documents holds a token")
    for key, what in (("eod", "end with EOD"), ("bos", "start with BOS")):
        found = checks[key]
        if found["finding"] == MIXED:
            raise ValueError(
                f"{prefix}: {found['found']} of {found['sampled']} sampled documents {what} (id "
                f"{found['id']}), the others do not: one policy must describe every document; "
                f"tokenize it again with one policy")


def _manifest(prefix: str, tokenizer: Tokenizer, checks: dict, files: dict,
              adopted: dict) -> dict:
    """The manifest aoe-preprocess writes (preprocess._run_group), for an adopted corpus."""
    return {
        "format": "aoe-megatron-preprocess",
        "version": MANIFEST_VERSION,
        "dataset_prefix": os.path.abspath(prefix),
        "json_key": None,
        "subset": None,
        "tokenizer": tokenizer.describe(),
        "policy": {"prepend_bos": checks["bos"]["finding"] == ALL,
                   "append_eod": checks["eod"]["finding"] == ALL},
        "dtype": checks["dtype"],
        "documents": checks["documents"],
        "tokens": checks["tokens"],
        "sources": [],
        "files": files,
        "adopted": adopted,
    }


def _warn_no_eod(prefix: str, checks: dict, say: Callable[[str], None]) -> None:
    if checks["eod"]["finding"] == NONE:
        say(f"WARNING: none of the {checks['eod']['sampled']} sampled documents of {prefix} ends "
            f"with EOD (id {checks['eod']['id']}): recorded as append_eod false, and training "
            f"refuses it (it needs EOD-separated documents: tokenize it again with --append-eod)")


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def adopt(prefix: str, tokenizer_model=None, *, overwrite: bool = False,
          progress: Optional[Callable[[int], None]] = None,
          say: Optional[Callable[[str], None]] = None) -> dict:
    """Check the Megatron-LM dataset ``prefix`` (``inspect_corpus``) and write the manifest
    aoe-preprocess would have written, ``PREFIX.manifest.json`` (atomically); returns it.

    The tokenizer is ``tokenizer_model`` (None: the default one). The policy is what was found:
    ``prepend_bos`` / ``append_eod`` when every sampled document starts with BOS / ends with EOD.
    Both files are hashed (``progress(n)`` after each chunk), so ``aoe-verify-data PREFIX``
    verifies the corpus from then on. ``sources`` is empty (the JSONL is unknown) and
    ``"adopted": {"from": "megatron-lm", "when", "checks"}`` records the findings.

    Raises ValueError (``CorpusDamaged`` for the structure) with the reason: a damaged pair, token
    ids outside the tokenizer's vocabulary, some sampled documents with EOD (or BOS) and others
    without, a manifest already there (unless ``overwrite``). No EOD at all is adopted with
    ``append_eod`` false and a warning through ``say`` (default: stderr): training refuses it.
    """
    say = say or _stderr
    path = f"{prefix}.manifest.json"
    if os.path.exists(path) and not overwrite:
        raise ValueError(f"{path} exists; pass --overwrite to replace it")
    tokenizer = Tokenizer(tokenizer_model)
    checks = inspect_corpus(prefix, tokenizer)
    _judge(prefix, checks, tokenizer)
    _warn_no_eod(prefix, checks, say)
    files = {key: file_record(f"{prefix}.{key}", progress=progress) for key in ("bin", "idx")}
    when = datetime.now(timezone.utc).isoformat(timespec="seconds")
    manifest = _manifest(prefix, tokenizer, checks, files,
                         {"from": "megatron-lm", "when": when, "checks": checks})
    if os.path.exists(path) and not overwrite:  # NOTE: written by someone else while we hashed
        raise ValueError(f"{path} exists; pass --overwrite to replace it")
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as fh:
            json.dump(manifest, fh, indent=2, sort_keys=True)
            fh.write("\n")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return manifest


def unadopted_manifest(prefix: str, tokenizer_model=None, *,
                       say: Optional[Callable[[str], None]] = None) -> dict:
    """For training's ``--no-manifest``: ``adopt``'s checks and manifest, held in memory only.

    The cost is bounded, for terabyte corpora too: the ``.idx`` is read (about 20 bytes per
    document) and a bounded sample of the ``.bin`` (``inspect_corpus``); no file is read whole
    and none is hashed or written. ``files`` records the sizes only (``{"size": n}``: the launch
    checks compare them), and ``"adopted": {"from": "megatron-lm", "unadopted": True}``.
    Otherwise equal to the manifest ``adopt`` would write; refuses what ``adopt`` refuses
    (except an existing manifest: it is not read).
    """
    tokenizer = Tokenizer(tokenizer_model)
    checks = inspect_corpus(prefix, tokenizer)
    _judge(prefix, checks, tokenizer)
    _warn_no_eod(prefix, checks, say or _stderr)
    files = {key: {"size": os.path.getsize(f"{prefix}.{key}")} for key in ("bin", "idx")}
    return _manifest(prefix, tokenizer, checks, files,
                     {"from": "megatron-lm", "unadopted": True})
