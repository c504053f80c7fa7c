#!/usr/bin/env python
"""Train a Llama-style sentencepiece BPE tokenizer from text or JSONL.

    python tools/train_tokenizer.py --input assets/corpus/shakespeare.jsonl \\
        --output-prefix assets/tokenizer/shakespeare32k --vocab-size 32000

Byte fallback, split digits, identity normalisation, unk/bos/eos = 0/1/2, byte pieces 3-258.
"""

import argparse
import glob
import sys

from aoe_megatron.data.train_tokenizer import train_tokenizer


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input", nargs="+", required=True, help=".txt, .jsonl(.gz/.zst) files or globs")
    ap.add_argument("--output-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--json-key", default="text")
    ap.add_argument("--input-sentence-size", type=int, default=2_000_000,
                    help="lines sampled for training (sentencepiece's limit)")
    args = ap.parse_args(argv)
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
