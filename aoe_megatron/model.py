"""Deprecated import path, kept for one release: ``aoe_megatron.model`` is now
``aoe_megatron.models.gpt`` (ModelConfig, load_preset, transformer_config, build_gpt_model). This name is that module itself."""

import sys
import warnings

from aoe_megatron.models import gpt as _moved

warnings.warn("aoe_megatron.model is deprecated: import aoe_megatron.models.gpt", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _moved
