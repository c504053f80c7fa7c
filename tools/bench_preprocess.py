#!/usr/bin/env python
"""Deprecated: use `aoe-bench-preprocess` (aoe_megatron.cli.bench_preprocess); this wrapper goes in the next release."""

import sys

from aoe_megatron.cli.bench_preprocess import main, parser  # noqa: F401  (importable, as before)

if __name__ == "__main__":
    print("note: tools/bench_preprocess.py is deprecated: use aoe-bench-preprocess", file=sys.stderr)
    raise SystemExit(main())
