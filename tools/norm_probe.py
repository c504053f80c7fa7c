#!/usr/bin/env python
"""Deprecated: use `aoe-norm-probe` (aoe_megatron.cli.norm_probe); this wrapper goes in the next release."""

import sys

from aoe_megatron.cli.norm_probe import main, parser  # noqa: F401  (importable, as before)

if __name__ == "__main__":
    print("note: tools/norm_probe.py is deprecated: use aoe-norm-probe", file=sys.stderr)
    raise SystemExit(main())
