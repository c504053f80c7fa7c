"""aoe-megatron: Autonomy-of-Experts (arXiv 2501.13074) as megatron-core components.

Rooms: ``moe`` (the AoE layer), ``models`` (presets, specs, the GPT builder), ``runtime``
(process groups, optional kernels, package data), ``data``, ``train``, ``hf``, ``evaluation``,
``bench``, ``study``, ``cli`` (the console scripts). The changes made to upstream engines live in
the repository's ``patches/`` folder, installed as ``aoe_megatron._patches``; presets, DeepSpeed
configs and the Slurm template live in ``run/``, installed as ``aoe_megatron._run``.
"""

from pathlib import Path as _Path

#: The one megatron-core release this package supports: every module in patches/ was written
#: against it (tests/test_packaging.py keeps pyproject.toml and requirements.txt in step).
MEGATRON_CORE_VERSION = "0.16.1"


def _check_megatron_core() -> None:
    """Refuse, at import, a megatron-core other than the supported one (read from the installed
    distribution's metadata, without importing megatron). ``AOE_ALLOW_UNTESTED_MCORE=1`` only
    warns: for porting the patches to a new release."""
    import importlib.metadata
    import os
    import warnings

    try:
        found = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        found = None
    if found == MEGATRON_CORE_VERSION:
        return
    said = (f"aoe-megatron {__version__} supports megatron-core {MEGATRON_CORE_VERSION} only (its "
            f"patches are written against that release), but "
            f"{'no megatron-core' if found is None else 'megatron-core ' + found} is installed: "
            f"pip install megatron-core=={MEGATRON_CORE_VERSION}")
    if os.environ.get("AOE_ALLOW_UNTESTED_MCORE") == "1":
        warnings.warn(said + " (AOE_ALLOW_UNTESTED_MCORE=1: going on)", stacklevel=3)
        return
    raise ImportError(said)


def _mapped_from_a_checkout(package: str, folder_name: str) -> None:
    """Run from a checkout that is not installed (its root on ``sys.path``, as the GPU check
    does on the device): ``package`` (``aoe_megatron._patches``, ``aoe_megatron._run``) is then
    the ``folder_name`` folder beside the package. Installed (wheel or ``pip install -e``), the
    package's own mapping finds it."""
    import importlib.util
    import sys

    here = _Path(__file__).resolve().parent
    folder = here.parent / folder_name
    if (here / package.rsplit(".", 1)[1]).is_dir() or package in sys.modules:
        return
    if importlib.util.find_spec(package) is not None or not folder.is_dir():
        return
    spec = importlib.util.spec_from_file_location(
        package, folder / "__init__.py", submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)


__version__ = "0.1.0"

_check_megatron_core()
from aoe_megatron.runtime.compat import quiet_cpu_fallback_warnings  # noqa: E402

quiet_cpu_fallback_warnings()  # before the patches import megatron-core
_mapped_from_a_checkout("aoe_megatron._patches", "patches")
_mapped_from_a_checkout("aoe_megatron._run", "run")

from aoe_megatron._patches import apply_patches  # noqa: E402
from aoe_megatron._patches import mcore_jit as _mcore_jit  # noqa: E402

_mcore_jit.arm()  # before megatron-core loads: it decorates its kernels as it imports

__all__ = ["apply_patches", "MEGATRON_CORE_VERSION", "__version__"]
