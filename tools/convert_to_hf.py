#!/usr/bin/env python
"""Deprecated: use `aoe-convert-to-hf` (aoe_megatron.cli.convert_to_hf); this wrapper goes in the next release."""

import sys

from aoe_megatron.cli.convert_to_hf import main, parser  # noqa: F401  (importable, as before)

if __name__ == "__main__":
    print("note: tools/convert_to_hf.py is deprecated: use aoe-convert-to-hf", file=sys.stderr)
    raise SystemExit(main())
