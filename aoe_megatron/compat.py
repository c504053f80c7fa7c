"""Run-time detection of optional GPU components: CUDA, TransformerEngine, NVIDIA apex.

None is required: each is used when present. NVIDIA apex is not on PyPI (the PyPI package named
``apex`` is unrelated): it counts only when it has NVIDIA's fused kernels.
"""

from __future__ import annotations

import importlib.util
import warnings

import torch


def have_nvidia_apex() -> bool:
    """True only for NVIDIA apex (built from github.com/NVIDIA/apex), never PyPI's ``apex``."""
    if importlib.util.find_spec("apex") is None:
        return False
    return (
        importlib.util.find_spec("apex.normalization") is not None
        and importlib.util.find_spec("apex.optimizers") is not None
    )


def have_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def runtime_summary() -> str:
    """One line saying which device and optional kernels this run uses."""
    if torch.cuda.is_available():
        device = f"cuda ({torch.cuda.get_device_name()}), NCCL"
    else:
        device = "cpu, gloo"
    te = "yes" if have_transformer_engine() and torch.cuda.is_available() else "no"
    apex = "yes" if have_nvidia_apex() and torch.cuda.is_available() else "no"
    return f"device: {device}; TransformerEngine: {te}; NVIDIA apex: {apex}"


def quiet_cpu_fallback_warnings() -> None:
    """Without CUDA, megatron-core warns on import that TE and apex are missing: expected here."""
    if not torch.cuda.is_available():
        warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
        warnings.filterwarnings("ignore", message="full scope is deprecated")
