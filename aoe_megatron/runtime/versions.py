"""Which megatron-core releases aoe-megatron supports, and the one check of the installed one.

Supported means tested: each release below has a CI leg (``make test`` runs 0.16.1 on Python
3.11, ``make test-mcore019`` runs 0.19.2 on Python 3.12; docs/compatibility.md). Every module in
``aoe_megatron.patches`` declares which of them it applies to. Any other release is refused at
``import aoe_megatron``; ``AOE_ALLOW_UNTESTED_MCORE=1`` turns the refusal into a warning, for
trying a new release, and the patches then follow the nearest supported release below it.

This module reads the installed distribution's metadata and never imports megatron-core.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import warnings
from functools import lru_cache

#: The megatron-core releases CI tests, oldest first.
SUPPORTED_MCORE = ("0.16.1", "0.19.2")
#: The environment variable that lets an untested megatron-core through, with a warning.
ALLOW_UNTESTED = "AOE_ALLOW_UNTESTED_MCORE"


def parse(version: str) -> tuple[int, ...]:
    """"0.19.2" -> (0, 19, 2); what follows the leading numbers ("rc1", "+local") is dropped."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(n) for n in match.group(0).split(".")) if match else ()


@lru_cache(maxsize=None)
def installed_mcore() -> str | None:
    """The installed megatron-core's version, or None."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def refusal(found: str | None) -> str:
    """The sentence an unsupported megatron-core gets."""
    which = "no megatron-core" if found is None else f"megatron-core {found}"
    return (f"aoe-megatron supports megatron-core {' and '.join(SUPPORTED_MCORE)} (the releases "
            f"its CI tests; 0.17 and later need Python 3.12), but {which} is installed: install a "
            f"supported one (pip install megatron-core=={SUPPORTED_MCORE[-1]} on Python 3.12, "
            f"=={SUPPORTED_MCORE[0]} on 3.11), or set {ALLOW_UNTESTED}=1 to try this one anyway")


def check_mcore(found: str | None = None) -> None:
    """Refuse an unsupported megatron-core (``ImportError``), or only warn under
    ``AOE_ALLOW_UNTESTED_MCORE=1`` (never without one installed)."""
    found = installed_mcore() if found is None else found
    if found in SUPPORTED_MCORE:
        return
    if found is not None and os.environ.get(ALLOW_UNTESTED) == "1":
        warnings.warn(f"{refusal(found)} ({ALLOW_UNTESTED}=1: going on, with the patches of "
                      f"megatron-core {baseline_release(found)})", stacklevel=3)
        return
    raise ImportError(refusal(found))


def baseline_release(found: str | None = None) -> str:
    """The supported release whose patches and shims apply: the installed one where supported,
    else the newest supported release not newer than it (the oldest for anything older)."""
    found = installed_mcore() if found is None else found
    if found in SUPPORTED_MCORE or found is None:
        return found or SUPPORTED_MCORE[0]
    older = [v for v in SUPPORTED_MCORE if parse(v) <= parse(found)]
    return older[-1] if older else SUPPORTED_MCORE[0]


@lru_cache(maxsize=None)
def mcore_at_least(version: str) -> bool:
    """Whether the installed megatron-core is ``version`` or newer (shims at upstream seams; cached:
    the loss tracker asks at every router forward)."""
    found = installed_mcore()
    return found is not None and parse(found) >= parse(version)


#: Keyword arguments megatron-core's MoE constructors gained after 0.16.1, with the release that
#: added them: ``MoELayer`` builds its router with ``is_mtp_layer`` (0.17), ``TransformerLayer``
#: builds its MLP with ``is_mtp_layer`` and ``name``, and ``MoELayer`` its experts with ``name``
#: (0.18).
NEWER_CONSTRUCTOR_ARGS = {"is_mtp_layer": "0.17", "name": "0.18"}


def constructor_kwargs(**kwargs) -> dict:
    """Of ``kwargs`` (names in ``NEWER_CONSTRUCTOR_ARGS``), those the installed megatron-core's
    constructors take: what our subclasses pass on to theirs."""
    return {k: v for k, v in kwargs.items() if mcore_at_least(NEWER_CONSTRUCTOR_ARGS[k])}


def refuse_mtp(is_mtp_layer: bool, what: str) -> None:
    """Multi-token prediction layers (megatron-core 0.17+ says so to MoE routers and layers) are
    not built with AoE or the ablations' routers."""
    if is_mtp_layer:
        raise ValueError(f"{what} does not support multi-token prediction layers: unset mtp_num_layers")
