#!/usr/bin/env python
"""Deprecated: use `aoe-checkpoints` (aoe_megatron.cli.checkpoints); this wrapper goes in the next release."""

import sys

from aoe_megatron.cli.checkpoints import main, parser  # noqa: F401  (importable, as before)

if __name__ == "__main__":
    print("note: tools/checkpoints.py is deprecated: use aoe-checkpoints", file=sys.stderr)
    raise SystemExit(main())
