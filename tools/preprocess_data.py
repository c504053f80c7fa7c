#!/usr/bin/env python
"""JSONL corpora (RedPajama format: {"text": ..., "meta": {...}}) to megatron-core indexed datasets.

    python tools/preprocess_data.py --input 'redpajama/arxiv/*.jsonl.zst' \\
        --output-prefix data/redpajama --append-eod --workers 16

writes data/redpajama_text_document.{bin,idx} and .manifest.json. With --per-input, each
--input (NAME=GLOB to name it) gets its own dataset, for blending. Flag names follow
Megatron-LM's tools/preprocess_data.py where they apply.
"""

import argparse
import sys

from aoe_megatron.data.preprocess import PreprocessConfig, PreprocessError, preprocess


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input", nargs="+", required=True,
                    help="files or globs (.jsonl, .jsonl.gz, .jsonl.zst); NAME=GLOB names a subset")
    ap.add_argument("--output-prefix", required=True, help="output path prefix")
    ap.add_argument("--json-keys", nargs="+", default=["text"], help="fields to tokenize (default: text)")
    ap.add_argument("--tokenizer-model", help="sentencepiece model (default: the Llama-compatible "
                    "32k model fetched by `make assets`)")
    ap.add_argument("--append-eod", action="store_true", help="append the EOS id after each document")
    ap.add_argument("--prepend-bos", action="store_true", help="prepend the BOS id to each document")
    ap.add_argument("--workers", type=int, default=1, help="tokenizer processes (0: in-process)")
    ap.add_argument("--per-input", action="store_true", help="one dataset per --input, for blending")
    ap.add_argument("--strict", action="store_true", help="fail on any rejected record")
    ap.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    ap.add_argument("--log-interval", type=float, default=5.0, help="seconds between progress lines")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = PreprocessConfig(
        inputs=tuple(args.input), output_prefix=args.output_prefix, json_keys=tuple(args.json_keys),
        tokenizer_model=args.tokenizer_model, append_eod=args.append_eod,
        prepend_bos=args.prepend_bos, workers=args.workers, per_input=args.per_input,
        strict=args.strict, overwrite=args.overwrite, log_interval=args.log_interval,
    )
    try:
        results = preprocess(cfg)
    except (PreprocessError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for prefix, m in results.items():
        print(f"wrote {prefix}.{{bin,idx}}: {m['documents']:,} documents, {m['tokens']:,} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
