#!/usr/bin/env python
"""Deprecated: use `aoe-ablation-table` (aoe_megatron.cli.ablation_table); this wrapper goes in 0.2.0
(``aoe_megatron/runtime/deprecations.py``)."""

import sys

from aoe_megatron.cli.ablation_table import main, parser  # noqa: F401  (importable, as before)
from aoe_megatron.runtime.deprecations import deprecation

if __name__ == "__main__":
    print(f"note: {deprecation('tools/ablation_table.py').notice()}", file=sys.stderr)
    raise SystemExit(main())
