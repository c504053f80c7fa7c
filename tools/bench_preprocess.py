#!/usr/bin/env python
"""Deprecated: use `aoe-bench-preprocess` (aoe_megatron.cli.bench_preprocess); this wrapper goes in 0.2.0
(``aoe_megatron/runtime/deprecations.py``)."""

import sys

from aoe_megatron.cli.bench_preprocess import main, parser  # noqa: F401  (importable, as before)
from aoe_megatron.runtime.deprecations import deprecation

if __name__ == "__main__":
    print(f"note: {deprecation('tools/bench_preprocess.py').notice()}", file=sys.stderr)
    raise SystemExit(main())
