"""Deprecated import path: ``aoe_megatron.model`` is now ``aoe_megatron.models.gpt`` (ModelConfig, load_preset, transformer_config, build_gpt_model). This
name is that module itself, until 0.2.0 (``runtime/deprecations.py``)."""

import sys
import warnings

from aoe_megatron.models import gpt as _moved
from aoe_megatron.runtime.deprecations import deprecation

warnings.warn(deprecation(__name__).notice(), DeprecationWarning, stacklevel=2)
sys.modules[__name__] = _moved
