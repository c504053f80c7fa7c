#!/usr/bin/env python
"""Deprecated: use `aoe-preprocess` (aoe_megatron.cli.preprocess); this wrapper goes in the next release."""

import sys

from aoe_megatron.cli.preprocess import main, parser  # noqa: F401  (importable, as before)

if __name__ == "__main__":
    print("note: tools/preprocess_data.py is deprecated: use aoe-preprocess", file=sys.stderr)
    raise SystemExit(main())
