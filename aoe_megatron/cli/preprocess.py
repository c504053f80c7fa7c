"""``aoe-preprocess``: JSONL corpora (RedPajama format: {"text": ..., "meta": {...}}) to
megatron-core indexed datasets.

    aoe-preprocess --input 'redpajama/arxiv/*.jsonl.zst' \\
        --output-prefix data/redpajama --append-eod --workers 16

writes data/redpajama_text_document.{bin,idx} and .manifest.json. A folder given as --input
stands for its .jsonl(.gz/.zst) files (``--input redpajama/arxiv``). With --per-input, each
--input (NAME=GLOB to name it) gets its own dataset, for blending. Flag names follow
Megatron-LM's tools/preprocess_data.py where they apply.
"""

from __future__ import annotations

import argparse
import sys

from aoe_megatron.data.preprocess import PreprocessConfig, PreprocessError, preprocess
from aoe_megatron.runtime.command_line import CommandParser

#: Megatron-LM's --tokenizer-type values taken here (each a sentencepiece model, --tokenizer-model)
#: -> whether each document starts with BOS (Megatron-LM's Llama2Tokenizer prepends it).
TOKENIZER_TYPES = {"GPTSentencePieceTokenizer": False, "SentencePieceTokenizer": False,
                   "Llama2Tokenizer": True}


def parser() -> argparse.ArgumentParser:
    ap = CommandParser(
        prog="aoe-preprocess", allow_abbrev=False,
        description="Tokenize JSONL corpora (RedPajama format) into megatron-core indexed "
                    "datasets (PREFIX_text_document.bin/.idx) with a manifest of what went in.")
    ap.add_argument("--input", nargs="+", required=True, metavar="[NAME=]GLOB",
                    help="input files, globs (.jsonl, .jsonl.gz, .jsonl.zst) or folders (a "
                         "folder: its .jsonl, .jsonl.gz and .jsonl.zst files, not its "
                         "subfolders'); NAME=GLOB names a subset (its dataset's name with "
                         "--per-input; a folder's default name is its own); required")
    ap.add_argument("--output-prefix", required=True,
                    help="path prefix of the outputs: PREFIX_<key>_document.{bin,idx} and "
                         ".manifest.json; required")
    ap.add_argument("--json-keys", nargs="+", default=["text"],
                    help="JSON fields to tokenize, one dataset per field (default: %(default)s)")
    ap.add_argument("--tokenizer-model",
                    help="sentencepiece model file to tokenize with (default: the "
                         "Llama-compatible 32k model fetched by aoe-fetch-assets)")
    ap.add_argument("--tokenizer-type", metavar="TYPE",
                    help="Megatron-LM's tokenizer type, for its scripts: GPTSentencePieceTokenizer "
                         "or SentencePieceTokenizer (the --tokenizer-model file as is) or "
                         "Llama2Tokenizer (the same, with BOS before each document: "
                         "--prepend-bos); any other type is refused (default: a sentencepiece "
                         "model, as GPTSentencePieceTokenizer)")
    ap.add_argument("--append-eod", action="store_true",
                    help="append the EOS id after each document (default: off)")
    ap.add_argument("--prepend-bos", action="store_true",
                    help="prepend the BOS id to each document (default: off)")
    ap.add_argument("--workers", type=int, default=1,
                    help="tokenizer processes; 0 tokenizes in the main process "
                         "(default: %(default)s)")
    ap.add_argument("--per-input", action="store_true",
                    help="write one dataset per --input, for blending, instead of one for all "
                         "(default: off)")
    ap.add_argument("--strict", action="store_true",
                    help="fail on the first rejected record instead of counting and skipping it "
                         "(default: off)")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace outputs that exist instead of refusing (default: off)")
    ap.add_argument("--log-interval", type=float, default=5.0,
                    help="seconds between progress lines (default: %(default)s)")
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.tokenizer_type is not None and args.tokenizer_type not in TOKENIZER_TYPES:
        ap.error(f"--tokenizer-type {args.tokenizer_type} is not supported: aoe-preprocess "
                 f"tokenizes with a sentencepiece model (--tokenizer-model); the types it takes "
                 f"are {', '.join(TOKENIZER_TYPES)}")
    if TOKENIZER_TYPES.get(args.tokenizer_type):
        args.prepend_bos = True
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
    if not cfg.append_eod:
        print("WARNING: no EOD token was appended to the documents (--append-eod not given): "
              "aoe-train refuses such a dataset, since its documents would run into each other. "
              "Preprocess again with --append-eod to train on it", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from aoe_megatron.runtime.exit import exit_now

    exit_now(main())  # as SystemExit(main()), less a second of interpreter teardown
