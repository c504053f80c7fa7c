#!/usr/bin/env python
"""Deprecated: use `aoe-mcnemar` (aoe_megatron.cli.mcnemar); this wrapper goes in the next release."""

import sys

from aoe_megatron.cli.mcnemar import main, parser  # noqa: F401  (importable, as before)

if __name__ == "__main__":
    print("note: tools/mcnemar.py is deprecated: use aoe-mcnemar", file=sys.stderr)
    raise SystemExit(main())
