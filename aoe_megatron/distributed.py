"""Deprecated import path: ``aoe_megatron.distributed`` is now ``aoe_megatron.runtime.distributed`` (init_megatron and the collectives). This
name is that module itself, until 0.2.0 (``runtime/deprecations.py``)."""

import sys
import warnings

from aoe_megatron.runtime import distributed as _moved
from aoe_megatron.runtime.deprecations import deprecation

warnings.warn(deprecation(__name__).notice(), DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
