"""Patch for ``megatron/core/inference/contexts/dynamic_context.py`` (megatron-core 0.16.1, 0.19.2),
on every device, where Weights & Biases is installed.

What: the ``import wandb`` that megatron-core runs as it loads (in this file, the first on every
import path, and in ``timers.py`` and ``inference/engines/dynamic_engine.py``) binds a module that
runs wandb's code on its first attribute use, not at import. A process that logs to W&B (``aoe-train
--wandb-project``) loads it then, as before; one that does not, never does.
Why: ``import megatron.core`` imports this module through ``inference_params``, and it imports wandb
only to set a flag (``HAVE_WANDB``). wandb's import (its SDK, pydantic models, protobuf) costs about
0.9 s of every process's start, about a tenth of a tiny training run, on every rank of every job,
whether it logs to W&B or not. Nothing in megatron-core reads a wandb attribute while it imports.
How: :func:`arm` (called by ``import aoe_megatron``) puts an import hook in place that finds
``wandb`` as Python would and gives its module object the import system's attributes only; the
first other attribute read runs wandb's code in that object.
It does nothing where wandb is not installed or already imported. Where megatron-core was
imported before aoe_megatron, wandb is already loaded: :func:`apply` has nothing to change.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

TARGET = "megatron.core.inference.contexts.dynamic_context"
#: The supported megatron-core releases this patch applies to.
VERSIONS = ("0.16.1", "0.19.2")
LAZY = "wandb"


class _Deferred(types.ModuleType):
    """The wandb module before its code has run: the import system's own attributes
    (``__spec__``, ``__path__``, ...) are there, so another ``import wandb`` finds it imported;
    the first attribute it lacks runs wandb's code in this module object, once."""

    def __getattr__(self, attr):
        self.__class__ = types.ModuleType  # from here on, a plain module
        self.__spec__.loader.exec_module(self)
        return getattr(self, attr)


class _DeferringLoader(importlib.abc.Loader):
    """Creates the module as ``loader`` would and defers running its code (unlike the standard
    library's ``LazyLoader``, whose module runs at the next ``import wandb`` statement, which
    reads ``__spec__``)."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__spec__.loader = module.__loader__ = self.loader
        module.__class__ = _Deferred


class _DeferringFinder(importlib.abc.MetaPathFinder):
    """Finds ``wandb`` as Python would and defers running it. It stays in place: a
    ``find_spec("wandb")`` probe (as optional-dependency checks make) finds without importing."""

    name = LAZY

    def find_spec(self, name, path, target=None):
        if name != LAZY:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _DeferringLoader(spec.loader)
        return spec


def is_deferred(module) -> bool:
    """Whether ``module``'s code has not run yet."""
    return type(module) is _Deferred


def arm() -> None:
    """Defer running wandb's code from now on, in this process. Does nothing where it is already imported
    or the hook is already in place."""
    if LAZY in sys.modules or any(isinstance(f, _DeferringFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _DeferringFinder())


def apply() -> bool:
    """Nothing to change once megatron-core has loaded (the hook works at import): False."""
    return False
