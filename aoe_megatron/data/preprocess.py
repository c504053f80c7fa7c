"""JSONL corpora (RedPajama and alike) to megatron-core indexed datasets (.bin/.idx).

Streaming and memory-bounded: the main process reads lines in chunks of about 1 MB, workers
validate and tokenize them, and results are written in input order, so the output is
byte-identical for any number of workers. Outputs appear under their final names only when
complete (the .idx, which makes a dataset readable, is renamed last, after its manifest).
"""

from __future__ import annotations

import glob
import json
import multiprocessing as mp
import os
import socket
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from aoe_megatron.data.inputs import PreprocessError, resolve_inputs
from aoe_megatron.data.integrity import HashingWriter, file_record
from aoe_megatron.data.manifest import MANIFEST_VERSION
from aoe_megatron.data.reader import SourceFile, TruncatedStream
from aoe_megatron.data.records import REASONS, RecordEncoder
from aoe_megatron.data.tokenizer import Tokenizer

EXAMPLES_PER_REASON = 5


@dataclass(frozen=True, kw_only=True)
class PreprocessConfig:
    inputs: tuple
    """Files, folders (their ``FOLDER_SUFFIXES`` files) or globs; ``NAME=GLOB`` names a subset
    (used by ``per_input``)."""
    output_prefix: str
    json_keys: tuple = ("text",)
    tokenizer_model: Optional[str] = None
    append_eod: bool = False
    prepend_bos: bool = False
    workers: int = 1
    per_input: bool = False
    strict: bool = False
    overwrite: bool = False
    chunk_bytes: int = 1 << 20
    log_interval: float = 5.0


@dataclass
class _Stats:
    documents: int = 0
    tokens: int = 0
    bytes: int = 0
    blank_lines: int = 0
    rejected: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)

    def reject(self, reason: str, where: str) -> None:
        self.rejected[reason] += 1
        self.examples.setdefault(reason, [])
        if len(self.examples[reason]) < EXAMPLES_PER_REASON:
            self.examples[reason].append(where)


def dataset_prefix(output_prefix: str, key: str, subset: Optional[str] = None) -> str:
    """Megatron-LM's naming: ``{prefix}[_{subset}]_{key}_document``."""
    middle = f"_{subset}" if subset else ""
    return f"{output_prefix}{middle}_{key}_document"


# --- worker side -------------------------------------------------------------------------------
_ENCODER: Optional[RecordEncoder] = None


def _init_worker(tokenizer_model, keys, prepend_bos, append_eod, dtype) -> None:
    global _ENCODER
    _ENCODER = RecordEncoder(Tokenizer(tokenizer_model), keys, prepend_bos=prepend_bos,
                             append_eod=append_eod, dtype=dtype)


def _encode(task):
    first_line, lines = task
    return _ENCODER.encode_chunk(first_line, lines)


# --- main side ---------------------------------------------------------------------------------
def _chunks(files, chunk_bytes, stats: _Stats, sources: list) -> Iterator[tuple[str, int, list]]:
    for path in files:
        src = SourceFile(path)
        lines, size, first, line_no = [], 0, 1, 0
        try:
            for line_no, line in enumerate(src.lines(), start=1):
                lines.append(line)
                size += len(line)
                if size >= chunk_bytes:
                    yield path, first, lines
                    lines, size, first = [], 0, line_no + 1
        except TruncatedStream as err:
            if lines:
                yield path, first, lines
                lines = []
            stats.reject("truncated_stream", f"{path}:{line_no + 1} ({err})")
        if lines:
            yield path, first, lines
        sources.append({"path": os.path.abspath(path), "size": src.size, "sha256": src.sha256})


class _Progress:
    def __init__(self, interval: float, label: str):
        self.interval, self.label = interval, label
        self.start = self.last = time.monotonic()

    def maybe(self, stats: _Stats, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self.last < self.interval:
            return
        self.last = now
        dt = max(now - self.start, 1e-9)
        rejected = sum(stats.rejected.values())
        print(
            f"[{self.label}] {'done' if final else 'progress'}: {stats.documents:,} docs "
            f"({stats.documents / dt:,.0f}/s), {stats.tokens:,} tokens ({stats.tokens / dt:,.0f}/s), "
            f"{stats.bytes / 1e6:,.1f} MB ({stats.bytes / 1e6 / dt:,.2f} MB/s), "
            f"{rejected:,} rejected, {dt:,.1f}s",
            file=sys.stderr, flush=True,
        )


_HOST = socket.gethostname().replace("-", "_")


def _partial(path: str) -> str:
    return f"{path}.partial-{_HOST}-{os.getpid()}"


def _remove_stale_partials(prefix: str) -> None:
    """Partial files left by killed runs on this host (process gone) are removed, with a note.

    NOTE: the host is in the name, so a run on another node sharing the file system is never
    mistaken for a dead one.
    """
    for path in glob.glob(f"{glob.escape(prefix)}.*.partial-{_HOST}-*"):
        pid = path.rsplit("-", 1)[-1]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            os.remove(path)
            print(f"removed {path}, left by an interrupted run", file=sys.stderr)


def _run_group(cfg: PreprocessConfig, tok: Tokenizer, subset: Optional[str], files, pool,
               dtype) -> dict:
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefixes = {k: dataset_prefix(cfg.output_prefix, k, subset if cfg.per_input else None)
                for k in cfg.json_keys}
    for prefix in prefixes.values():
        existing = [p for p in (f"{prefix}.bin", f"{prefix}.idx") if os.path.exists(p)]
        if existing and not cfg.overwrite:
            raise PreprocessError(f"{existing[0]} exists; pass --overwrite to replace it")
        Path(prefix).parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_partials(prefix)
    builders = {k: IndexedDatasetBuilder(_partial(f"{p}.bin"), dtype=dtype) for k, p in prefixes.items()}
    for builder in builders.values():  # the .bin is hashed as it is written
        builder.data_file = HashingWriter(builder.data_file)
    stats, sources = _Stats(), []
    progress = _Progress(cfg.log_interval, subset or Path(cfg.output_prefix).name)
    encoder = None if pool else RecordEncoder(tok, cfg.json_keys, prepend_bos=cfg.prepend_bos,
                                              append_eod=cfg.append_eod, dtype=dtype)
    window = deque()
    max_in_flight = 2 * max(cfg.workers, 1) + 2  # bounded: memory does not grow with the input

    def consume(path, result):
        for reason, line in result.rejected:
            stats.reject(reason, f"{path}:{line}")
        for key, builder in builders.items():
            ids, offset = result.ids[key], 0
            for n in result.lengths[key].tolist():
                builder.add_document(ids[offset : offset + n], [n])
                offset += n
            stats.tokens += int(result.lengths[key].sum())
        stats.documents += result.documents
        stats.blank_lines += result.blank_lines
        stats.bytes += result.bytes
        progress.maybe(stats)

    try:
        for path, first, lines in _chunks(files, cfg.chunk_bytes, stats, sources):
            if pool is None:
                consume(path, encoder.encode_chunk(first, lines))
                continue
            window.append((path, pool.apply_async(_encode, ((first, lines),))))
            if len(window) >= max_in_flight:
                p, res = window.popleft()
                consume(p, res.get())
        while window:
            p, res = window.popleft()
            consume(p, res.get())
        progress.maybe(stats, final=True)
        total_rejected = sum(stats.rejected.values())
        if cfg.strict and total_rejected:
            raise PreprocessError(f"--strict: {total_rejected} record(s) rejected: {_summary(stats)}")
        if stats.documents == 0:
            raise PreprocessError(f"no valid document in {files}: {_summary(stats) or 'empty input'}")
        manifests = {}
        for key, prefix in prefixes.items():
            builders[key].finalize(_partial(f"{prefix}.idx"))
            files = {"bin": file_record(_partial(f"{prefix}.bin"), writer=builders[key].data_file),
                     "idx": file_record(_partial(f"{prefix}.idx"))}  # the small .idx: read back
            manifest = {
                "format": "aoe-megatron-preprocess",
                "version": MANIFEST_VERSION,
                "dataset_prefix": os.path.abspath(prefix),
                "json_key": key,
                "subset": subset if cfg.per_input else None,
                "tokenizer": {k: v for k, v in tok.describe().items()},
                "policy": {"prepend_bos": cfg.prepend_bos, "append_eod": cfg.append_eod},
                "dtype": np.dtype(dtype).name,
                "documents": stats.documents,
                "tokens": int(sum(builders[key].sequence_lengths)),
                "blank_lines": stats.blank_lines,
                "rejected": {r: stats.rejected.get(r, 0) for r in REASONS},
                "rejected_examples": stats.examples,
                "sources": sources,
                "files": files,
            }
            _publish(prefix, manifest)
            manifests[key] = manifest
        return manifests
    finally:
        for key, prefix in prefixes.items():
            for leftover in (_partial(f"{prefix}.bin"), _partial(f"{prefix}.idx")):
                if os.path.exists(leftover):
                    os.remove(leftover)


def _publish(prefix: str, manifest: dict) -> None:
    """.bin, then the manifest, then the .idx: a readable dataset always has its manifest."""
    os.replace(_partial(f"{prefix}.bin"), f"{prefix}.bin")
    tmp = _partial(f"{prefix}.manifest.json")
    with open(tmp, "w") as fh:
        json.dump(manifest, fh, indent=2, sort_keys=True)
        fh.write("\n")
    os.replace(tmp, f"{prefix}.manifest.json")
    os.replace(_partial(f"{prefix}.idx"), f"{prefix}.idx")


def _summary(stats: _Stats) -> str:
    return ", ".join(
        f"{reason}: {n} (first at {', '.join(stats.examples.get(reason, []))})"
        for reason, n in sorted(stats.rejected.items())
    )


def preprocess(cfg: PreprocessConfig) -> dict:
    """Run preprocessing; returns {dataset prefix: manifest}. Raises PreprocessError."""
    if cfg.workers < 0:
        raise PreprocessError("--workers must be >= 0 (0 tokenizes in the main process)")
    if not cfg.json_keys:
        raise PreprocessError("--json-keys needs at least one key")
    groups = resolve_inputs(cfg.inputs)
    if not cfg.per_input:
        groups = [(None, [f for _, files in groups for f in files])]
    elif len({name for name, _ in groups}) != len(groups):
        raise PreprocessError("--per-input needs a distinct name per --input (use NAME=GLOB)")
    tok = Tokenizer(cfg.tokenizer_model)
    from megatron.core.datasets.indexed_dataset import DType

    dtype = DType.optimal_dtype(tok.vocab_size)
    pool = None
    if cfg.workers > 0:
        # NOTE: fork, so workers do not re-import torch; each loads the tokenizer once.
        pool = mp.get_context("fork").Pool(
            cfg.workers, initializer=_init_worker,
            initargs=(str(tok.path), cfg.json_keys, cfg.prepend_bos, cfg.append_eod, dtype),
        )
    results = {}
    try:
        for subset, files in groups:
            for key, manifest in _run_group(cfg, tok, subset, files, pool, dtype).items():
                results[manifest["dataset_prefix"]] = manifest
                if manifest["rejected"] and any(manifest["rejected"].values()):
                    print(f"rejected records in {manifest['dataset_prefix']}: "
                          f"{json.dumps({r: n for r, n in manifest['rejected'].items() if n})}; "
                          f"first: {json.dumps(manifest['rejected_examples'])}", file=sys.stderr)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    return results
