#!/usr/bin/env python
"""Deprecated: use `aoe-study` (aoe_megatron.cli.study); this wrapper goes in the next release."""

import sys

from aoe_megatron.cli.study import main, parser  # noqa: F401  (importable, as before)

if __name__ == "__main__":
    print("note: tools/study.py is deprecated: use aoe-study", file=sys.stderr)
    raise SystemExit(main())
