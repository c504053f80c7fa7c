#!/usr/bin/env python
"""Deprecated: use `aoe-convert-from-hf` (aoe_megatron.cli.convert_from_hf); this wrapper goes in the next release."""

import sys

from aoe_megatron.cli.convert_from_hf import main, parser  # noqa: F401  (importable, as before)

if __name__ == "__main__":
    print("note: tools/convert_from_hf.py is deprecated: use aoe-convert-from-hf", file=sys.stderr)
    raise SystemExit(main())
