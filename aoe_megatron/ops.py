"""Deprecated import path: ``aoe_megatron.ops`` is now ``aoe_megatron.moe.ops`` (the paper's formulas). This
name is that module itself, until 0.2.0 (``runtime/deprecations.py``)."""

import sys
import warnings

from aoe_megatron.moe import ops as _moved
from aoe_megatron.runtime.deprecations import deprecation

warnings.warn(deprecation(__name__).notice(), DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
