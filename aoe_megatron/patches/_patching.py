"""Small helpers shared by the patch modules: replace an attribute and remember the original.

Every patch goes through :func:`replace`, so :func:`revert_all` can restore megatron-core exactly
(the tests use this to show that each patch is needed).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from typing import Any, Callable

# (owner object, attribute name, original value) in the order they were replaced.
_ORIGINALS: list[tuple[Any, str, Any]] = []
_MISSING = object()


def replace(owner: Any, name: str, new: Any) -> None:
    """Set ``owner.name = new``, keeping the original for :func:`revert_all`."""
    _ORIGINALS.append((owner, name, owner.__dict__.get(name, _MISSING)))
    setattr(owner, name, new)


def replace_bound(name: str, new: Any, *module_names: str) -> None:
    """Replace a function in its defining module and in modules that imported it by name.

    NOTE: every module is imported *before* any replacement, so a by-name importer binds (and we
    record as the original) upstream's function, never ours.
    """
    owners = [module(m) for m in module_names]
    for owner in owners:
        replace(owner, name, new)


def revert_all() -> None:
    """Undo every replacement, newest first."""
    while _ORIGINALS:
        owner, name, original = _ORIGINALS.pop()
        if original is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, original)


def module(name: str):
    """Import and return a megatron-core module by dotted name."""
    return importlib.import_module(name)


def cuda_absent() -> bool:
    """CPU patches are active only on machines without CUDA."""
    import torch

    return not torch.cuda.is_available()


PatchFn = Callable[[], bool]


class _WhileLoading(importlib.abc.MetaPathFinder):
    """Finds module ``name`` as Python would, and runs its code through ``wrap(exec_module)``."""

    def __init__(self, name: str, wrap: Callable[[Callable], Callable]):
        self.name, self.wrap = name, wrap

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)  # one use; also keeps PathFinder below from finding us again
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader.exec_module = self.wrap(spec.loader.exec_module)
        return spec


def when_loading(name: str, wrap: Callable[[Callable], Callable]) -> None:
    """Change how module ``name`` executes when it is first imported: its loader's
    ``exec_module`` becomes ``wrap(exec_module)``. Does nothing where it is already imported or
    already hooked."""
    if name in sys.modules or any(isinstance(f, _WhileLoading) and f.name == name
                                  for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _WhileLoading(name, wrap))
