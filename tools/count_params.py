#!/usr/bin/env python
"""Deprecated: use `aoe-count-params` (aoe_megatron.cli.count_params); this wrapper goes in the next release."""

import sys

from aoe_megatron.cli.count_params import main, parser  # noqa: F401  (importable, as before)

if __name__ == "__main__":
    print("note: tools/count_params.py is deprecated: use aoe-count-params", file=sys.stderr)
    raise SystemExit(main())
