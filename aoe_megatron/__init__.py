"""aoe-megatron: Autonomy-of-Experts (arXiv 2501.13074) as megatron-core components."""

from patches import apply_patches

__version__ = "0.1.0"

__all__ = ["apply_patches", "__version__"]
