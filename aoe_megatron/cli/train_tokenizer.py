"""``aoe-train-tokenizer``: train a Llama-style sentencepiece BPE tokenizer from text or JSONL.

    aoe-train-tokenizer --input assets/corpus/shakespeare.jsonl \\
        --output-prefix assets/tokenizer/shakespeare32k --vocab-size 32000

Byte fallback, split digits, identity normalisation, unk/bos/eos = 0/1/2, byte pieces 3-258.
"""

from __future__ import annotations

import argparse
import glob
import sys

from aoe_megatron.data.train_tokenizer import train_tokenizer
from aoe_megatron.runtime.command_line import CommandParser


def parser() -> argparse.ArgumentParser:
    ap = CommandParser(
        prog="aoe-train-tokenizer", allow_abbrev=False,
        description="Train a Llama-style sentencepiece BPE tokenizer (byte fallback, split "
                    "digits, unk/bos/eos = 0/1/2) from text or JSONL files.")
    ap.add_argument("--input", nargs="+", required=True,
                    help="training text: .txt or .jsonl(.gz/.zst) files or globs; required")
    ap.add_argument("--output-prefix", required=True,
                    help="path prefix of the outputs PREFIX.model and PREFIX.vocab; required")
    ap.add_argument("--vocab-size", type=int, default=32000,
                    help="vocabulary size in pieces, the 259 special and byte pieces included "
                         "(default: %(default)s)")
    ap.add_argument("--json-key", default="text",
                    help="JSONL field holding the text; ignored for .txt (default: %(default)s)")
    ap.add_argument("--input-sentence-size", type=int, default=2_000_000,
                    help="lines sampled for training, sentencepiece's limit "
                         "(default: %(default)s)")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    files = [f for pattern in args.input for f in (sorted(glob.glob(pattern)) or [pattern])]
    try:
        model = train_tokenizer(files, args.output_prefix, vocab_size=args.vocab_size,
                                json_key=args.json_key,
                                input_sentence_size=args.input_sentence_size)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {model}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
