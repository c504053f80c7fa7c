"""Deprecated import path, kept for one release: ``aoe_megatron.distributed`` is now
``aoe_megatron.runtime.distributed`` (init_megatron and the collectives). This name is that module itself."""

import sys
import warnings

from aoe_megatron.runtime import distributed as _moved

warnings.warn("aoe_megatron.distributed is deprecated: import aoe_megatron.runtime.distributed", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _moved
