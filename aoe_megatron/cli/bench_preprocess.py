"""``aoe-bench-preprocess``: benchmark aoe-preprocess against the tokenizer's own speed (`make
bench-preprocess`).

Builds >= 50 MB of RedPajama-format JSONL from the real corpus (`make assets`; copies of its
documents in a different order each time), then measures in one run:
  - the tokenizer alone: a bare sentencepiece ``encode`` loop over the same documents, one process;
  - preprocessing with 1 and 2 workers (reading, validation, tokenization, writing, manifest).
Targets: 1 worker >= 0.85 of the tokenizer's speed; 2 workers >= 1.7x one worker.
Each figure is the best of --repeat runs: on a shared 2-core machine single runs vary by ~10%.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import resource
import tempfile
import time
from pathlib import Path

from aoe_megatron.data.assets import build_corpus
from aoe_megatron.data.preprocess import PreprocessConfig, preprocess
from aoe_megatron.data.tokenizer import Tokenizer
from aoe_megatron.runtime.command_line import CommandParser


def cpu_steal() -> tuple:
    """(steal jiffies, total jiffies) from /proc/stat: time the hypervisor gave to others."""
    try:
        fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    except OSError:
        return 0, 1
    return (fields[7] if len(fields) > 7 else 0), sum(fields)


def steal_share(before, after) -> float:
    return (after[0] - before[0]) / max(after[1] - before[1], 1)


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


def parser() -> argparse.ArgumentParser:
    ap = CommandParser(
        prog="aoe-bench-preprocess", allow_abbrev=False,
        description="Measure preprocessing throughput (tokens/s with 1 and 2 workers) against a "
                    "bare sentencepiece encode loop over the same generated JSONL input.")
    ap.add_argument("--min-mb", type=float, default=50.0,
                    help="size of the generated input in MB (10^6 bytes), at least "
                         "(default: %(default)s)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2],
                    help="preprocessing worker counts to measure; 0 tokenizes in the main "
                         "process (default: %(default)s)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs per figure; the best one counts (default: %(default)s)")
    ap.add_argument("--json",
                    help="also write the figures to this JSON file (default: print only)")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "bench.jsonl"
        texts = make_input(src, args.min_mb)
        mb = src.stat().st_size / 1e6
        tok = Tokenizer()
        # NOTE: import megatron-core (and torch) before timing: a fixed start-up cost, not speed.
        import megatron.core.datasets.indexed_dataset  # noqa: F401

        encode, base, base_cpu = tok.sp.encode, 0.0, 0.0
        for _ in range(args.repeat):
            t0, c0 = time.perf_counter(), time.process_time()
            tokens = sum(len(encode(t)) for t in texts)
            base = max(base, tokens / (time.perf_counter() - t0))
            base_cpu = max(base_cpu, tokens / (time.process_time() - c0))
        del texts
        rows = {"input_mb": round(mb, 1), "documents": None, "tokens": tokens,
                "tokenizer_tokens_per_s": round(base)}
        print(f"input: {mb:.1f} MB, {tokens:,} tokens; cores: {os.cpu_count()}")
        print(f"tokenizer alone (bare encode loop, 1 process): {base:,.0f} tokens/s")
        rows["tokenizer_tokens_per_cpu_s"] = round(base_cpu)
        speeds = {}
        for w in args.workers:
            cfg = PreprocessConfig(inputs=(str(src),), output_prefix=f"{tmp}/out{w}",
                                   append_eod=True, workers=w, log_interval=1e9)
            dt, cpu, steal = float("inf"), float("inf"), 0.0
            for _ in range(args.repeat):
                t0, s0 = time.perf_counter(), cpu_steal()
                r0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
                manifest = next(iter(preprocess(dataclasses.replace(cfg, overwrite=True)).values()))
                r1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
                if time.perf_counter() - t0 < dt:
                    dt, steal = time.perf_counter() - t0, steal_share(s0, cpu_steal())
                cpu = min(cpu, sum(b.ru_utime + b.ru_stime - a.ru_utime - a.ru_stime
                                   for a, b in zip(r0, r1)))
            speeds[w] = (manifest["tokens"] - manifest["documents"]) / dt  # EOD ids not counted
            rows[f"workers_{w}_cpu_efficiency"] = round(speeds[w] * dt / cpu / base_cpu, 2)
            rows[f"workers_{w}_steal_share"] = round(steal, 2)
            rows["documents"] = manifest["documents"]
            rows[f"workers_{w}_tokens_per_s"] = round(speeds[w])
            print(f"preprocess, {w} worker(s): {speeds[w]:,.0f} tokens/s = "
                  f"{speeds[w] / base:.2f} x tokenizer, {speeds[w] / max(w, 1) / base:.2f} per worker "
                  f"({dt:.1f}s, {mb / dt:.1f} MB/s); tokens per CPU-second (all processes) = "
                  f"{rows[f'workers_{w}_cpu_efficiency']:.2f} x tokenizer's; CPU stolen by the "
                  f"hypervisor during the run: {steal:.0%}")
        if 1 in speeds and 2 in speeds:
            rows["two_over_one"] = round(speeds[2] / speeds[1], 2)
            print(f"2 workers / 1 worker: {speeds[2] / speeds[1]:.2f}x")
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
