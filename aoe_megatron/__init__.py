"""aoe-megatron: Autonomy-of-Experts (arXiv 2501.13074) as megatron-core components.

Rooms: ``moe`` (the AoE layer), ``models`` (presets, specs, the GPT builder), ``runtime``
(process groups, versions, optional kernels, package data), ``patches`` (the changes made to
upstream engines), ``data``, ``train``, ``hf``, ``evaluation``, ``bench``, ``study``, ``cli`` (the
console scripts). Presets, DeepSpeed configs and the Slurm template live in the repository's
``run/``, installed as ``aoe_megatron._run``.

Importing the package does only what must happen before megatron-core loads, each step below
with its reason; everything else waits for an explicit call (``apply_patches`` at process-group
start).
"""

from pathlib import Path as _Path

__version__ = "0.1.0"


def _mapped_from_a_checkout(package: str, folder_name: str) -> None:
    """Run from a checkout that is not installed (its root on ``sys.path``, as the GPU check
    does on the device): ``package`` (``aoe_megatron._run``) is then the ``folder_name`` folder
    beside the package. Installed (wheel or ``pip install -e``), the package's own mapping finds
    it."""
    import importlib.util
    import sys

    here = _Path(__file__).resolve().parent
    folder = here.parent / folder_name
    if package in sys.modules or importlib.util.find_spec(package) is not None or not folder.is_dir():
        return
    spec = importlib.util.spec_from_file_location(
        package, folder / "__init__.py", submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)


from aoe_megatron.runtime.versions import SUPPORTED_MCORE, check_mcore  # noqa: E402

# 1. An unsupported megatron-core is refused before anything of it loads (its metadata only).
check_mcore()

# 2. Upstream's warnings about absent optional kernels are filtered before megatron-core prints them.
from aoe_megatron.runtime.compat import quiet_cpu_fallback_warnings  # noqa: E402

quiet_cpu_fallback_warnings()

# 3. run/ found beside the package in an uninstalled checkout (the GPU check's device).
_mapped_from_a_checkout("aoe_megatron._run", "run")

# 4. Import hooks that change megatron-core modules as they load (on a machine without CUDA):
#    its kernels are wrapped in torch.compile at import, which loads Inductor.
from aoe_megatron.patches import apply_patches, arm  # noqa: E402

arm()

__all__ = ["apply_patches", "SUPPORTED_MCORE", "__version__"]
