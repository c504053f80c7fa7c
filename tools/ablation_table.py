#!/usr/bin/env python
"""Deprecated: use `aoe-ablation-table` (aoe_megatron.cli.ablation_table); this wrapper goes in the next release."""

import sys

from aoe_megatron.cli.ablation_table import main, parser  # noqa: F401  (importable, as before)

if __name__ == "__main__":
    print("note: tools/ablation_table.py is deprecated: use aoe-ablation-table", file=sys.stderr)
    raise SystemExit(main())
