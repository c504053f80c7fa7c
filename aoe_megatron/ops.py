"""Deprecated import path, kept for one release: ``aoe_megatron.ops`` is now
``aoe_megatron.moe.ops`` (the paper's formulas). This name is that module itself."""

import sys
import warnings

from aoe_megatron.moe import ops as _moved

warnings.warn("aoe_megatron.ops is deprecated: import aoe_megatron.moe.ops", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _moved
