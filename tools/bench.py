#!/usr/bin/env python
"""Deprecated: use `aoe-bench` (aoe_megatron.cli.bench); this wrapper goes in the next release."""

import sys

from aoe_megatron.cli.bench import main, parser  # noqa: F401  (importable, as before)

if __name__ == "__main__":
    print("note: tools/bench.py is deprecated: use aoe-bench", file=sys.stderr)
    raise SystemExit(main())
