#!/usr/bin/env python
"""Deprecated: use `aoe-train-tokenizer` (aoe_megatron.cli.train_tokenizer); this wrapper goes in the next release."""

import sys

from aoe_megatron.cli.train_tokenizer import main, parser  # noqa: F401  (importable, as before)

if __name__ == "__main__":
    print("note: tools/train_tokenizer.py is deprecated: use aoe-train-tokenizer", file=sys.stderr)
    raise SystemExit(main())
