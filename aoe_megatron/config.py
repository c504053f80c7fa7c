"""Deprecated import path, kept for one release: ``aoe_megatron.config`` is now
``aoe_megatron.moe.config`` (AoEConfig and the layer's settings). This name is that module itself."""

import sys
import warnings

from aoe_megatron.moe import config as _moved

warnings.warn("aoe_megatron.config is deprecated: import aoe_megatron.moe.config", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _moved
