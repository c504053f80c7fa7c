#!/usr/bin/env python
"""Benchmark tools/preprocess_data.py against the tokenizer's own speed (`make bench-preprocess`).

Builds >= 50 MB of RedPajama-format JSONL from the real corpus (`make assets`; copies of its
documents in a different order each time), then measures in one run:
  - the tokenizer alone: a bare sentencepiece ``encode`` loop over the same documents, one process;
  - preprocessing with 1 and 2 workers (reading, validation, tokenization, writing, manifest).
Targets: 1 worker >= 0.85 of the tokenizer's speed; 2 workers >= 1.7x one worker.
Each figure is the best of --repeat runs: on a shared 2-core machine single runs vary by ~10%.
"""

import argparse
import dataclasses
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from aoe_megatron.data.assets import build_corpus
from aoe_megatron.data.preprocess import PreprocessConfig, preprocess
from aoe_megatron.data.tokenizer import Tokenizer


def make_input(path: Path, min_mb: float) -> list[str]:
    lines = build_corpus().read_text(encoding="utf-8").splitlines()
    out, size, copy = [], 0, 0
    while size < min_mb * 1e6:
        order = list(range(len(lines)))
        random.Random(copy).shuffle(order)
        for i in order:
            out.append(lines[i])
            size += len(lines[i].encode()) + 1
        copy += 1
    path.write_text("\n".join(out) + "\n", encoding="utf-8")
    return [json.loads(line)["text"] for line in out]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--min-mb", type=float, default=50.0)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2],
                    help="worker counts to measure (0: tokenize in the main process)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per figure; the best counts")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "bench.jsonl"
        texts = make_input(src, args.min_mb)
        mb = src.stat().st_size / 1e6
        tok = Tokenizer()
        # NOTE: import megatron-core (and torch) before timing: a fixed start-up cost, not speed.
        import megatron.core.datasets.indexed_dataset  # noqa: F401

        encode, base = tok.sp.encode, 0.0
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            tokens = sum(len(encode(t)) for t in texts)
            base = max(base, tokens / (time.perf_counter() - t0))
        del texts
        rows = {"input_mb": round(mb, 1), "documents": None, "tokens": tokens,
                "tokenizer_tokens_per_s": round(base)}
        print(f"input: {mb:.1f} MB, {tokens:,} tokens; cores: {os.cpu_count()}")
        print(f"tokenizer alone (bare encode loop, 1 process): {base:,.0f} tokens/s")
        speeds = {}
        for w in args.workers:
            cfg = PreprocessConfig(inputs=(str(src),), output_prefix=f"{tmp}/out{w}",
                                   append_eod=True, workers=w, log_interval=1e9)
            dt = float("inf")
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                manifest = next(iter(preprocess(dataclasses.replace(cfg, overwrite=True)).values()))
                dt = min(dt, time.perf_counter() - t0)
            speeds[w] = (manifest["tokens"] - manifest["documents"]) / dt  # EOD ids not counted
            rows["documents"] = manifest["documents"]
            rows[f"workers_{w}_tokens_per_s"] = round(speeds[w])
            print(f"preprocess, {w} worker(s): {speeds[w]:,.0f} tokens/s = "
                  f"{speeds[w] / base:.2f} x tokenizer, {speeds[w] / max(w, 1) / base:.2f} per worker "
                  f"({dt:.1f}s, {mb / dt:.1f} MB/s)")
        if 1 in speeds and 2 in speeds:
            rows["two_over_one"] = round(speeds[2] / speeds[1], 2)
            print(f"2 workers / 1 worker: {speeds[2] / speeds[1]:.2f}x")
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
