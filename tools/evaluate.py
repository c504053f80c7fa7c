#!/usr/bin/env python
"""Deprecated: use `aoe-evaluate` (aoe_megatron.cli.evaluate); this wrapper goes in the next release."""

import sys

from aoe_megatron.cli.evaluate import main, parser  # noqa: F401  (importable, as before)

if __name__ == "__main__":
    print("note: tools/evaluate.py is deprecated: use aoe-evaluate", file=sys.stderr)
    raise SystemExit(main())
