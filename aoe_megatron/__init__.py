"""aoe-megatron: Autonomy-of-Experts (arXiv 2501.13074) as megatron-core components.

Rooms: ``moe`` (the AoE layer), ``models`` (presets, specs, the GPT builder), ``runtime``
(process groups, optional kernels), ``data``, ``train``, ``hf``, ``evaluation``, ``bench``,
``study``. The changes made to upstream engines live in the repository's ``patches/`` folder,
installed as ``aoe_megatron._patches``.
"""

from pathlib import Path as _Path


def _patches_from_a_checkout() -> None:
    """Run from a checkout that is not installed (its root on ``sys.path``, as the GPU check
    does on the device): ``aoe_megatron._patches`` is then the ``patches/`` folder beside the
    package. Installed (wheel or ``pip install -e``), the package's own mapping finds it."""
    import importlib.util
    import sys

    here = _Path(__file__).resolve().parent
    folder = here.parent / "patches"
    if (here / "_patches").is_dir() or "aoe_megatron._patches" in sys.modules:
        return
    if importlib.util.find_spec("aoe_megatron._patches") is not None or not folder.is_dir():
        return
    spec = importlib.util.spec_from_file_location(
        "aoe_megatron._patches", folder / "__init__.py", submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)


_patches_from_a_checkout()

from aoe_megatron._patches import apply_patches  # noqa: E402

__version__ = "0.1.0"

__all__ = ["apply_patches", "__version__"]
