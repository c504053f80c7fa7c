#!/usr/bin/env python
"""Deprecated: use `aoe-norm-probe` (aoe_megatron.cli.norm_probe); this wrapper goes in 0.2.0
(``aoe_megatron/runtime/deprecations.py``)."""

import sys

from aoe_megatron.cli.norm_probe import main, parser  # noqa: F401  (importable, as before)
from aoe_megatron.runtime.deprecations import deprecation

if __name__ == "__main__":
    print(f"note: {deprecation('tools/norm_probe.py').notice()}", file=sys.stderr)
    raise SystemExit(main())
