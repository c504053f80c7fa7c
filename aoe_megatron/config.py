"""Deprecated import path: ``aoe_megatron.config`` is now ``aoe_megatron.moe.config`` (AoEConfig and the layer's settings). This
name is that module itself, until 0.2.0 (``runtime/deprecations.py``)."""

import sys
import warnings

from aoe_megatron.moe import config as _moved
from aoe_megatron.runtime.deprecations import deprecation

warnings.warn(deprecation(__name__).notice(), DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
