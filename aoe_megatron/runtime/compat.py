"""Run-time detection of optional GPU components: CUDA, TransformerEngine, NVIDIA apex.

None is required: each is used when present and working. TransformerEngine counts only when it
imports and runs on the GPU (``transformer_engine_usable``); NVIDIA apex is not on PyPI (the PyPI
package named ``apex`` is unrelated): it counts only when it has NVIDIA's fused kernels.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import sys
import warnings

# NOTE: torch is imported inside the functions: `import aoe_megatron` (every command's --help)
# must not load it.


def have_nvidia_apex() -> bool:
    """True only for NVIDIA apex (built from github.com/NVIDIA/apex), never PyPI's ``apex``."""
    if importlib.util.find_spec("apex") is None:
        return False
    return (
        importlib.util.find_spec("apex.normalization") is not None
        and importlib.util.find_spec("apex.optimizers") is not None
    )


def have_transformer_engine() -> bool:
    """TransformerEngine is installed (found, not imported): says nothing of whether it loads; the
    specs use it only when ``transformer_engine_usable``."""
    return importlib.util.find_spec("transformer_engine") is not None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def probe_transformer_engine(device: str = "cuda") -> str | None:
    """None when TE is usable on ``device``, else why not (one line).

    Usable: ``transformer_engine.pytorch`` imports, megatron-core's TE spec saw it at import (with
    the GroupedLinear its grouped experts need) and a TE RMSNorm forward runs on ``device``.
    NOTE: a broken install (a missing CUDA library, kernels built for another GPU) is still found
    by ``find_spec``, and fails only here, at import or at the first kernel.
    """
    import torch

    try:
        import transformer_engine.pytorch as te
    except Exception as exc:  # noqa: BLE001: any failure to load means "do not use it"
        return f"import transformer_engine.pytorch failed ({_one_line(exc)})"
    try:
        from megatron.core.extensions import transformer_engine as mcore_te
        from megatron.core.models.gpt import gpt_layer_specs
    except Exception as exc:  # noqa: BLE001
        return f"megatron-core's TransformerEngine wrappers do not import ({_one_line(exc)})"
    if not (gpt_layer_specs.HAVE_TE and mcore_te.HAVE_TE):
        return "megatron-core could not import TransformerEngine when it loaded its TE spec"
    if mcore_te.TEColumnParallelGroupedLinear is None:
        return "this TransformerEngine has no GroupedLinear (megatron-core needs TE >= 1.9 for grouped experts)"
    try:
        out = te.RMSNorm(8, device=device)(torch.ones(4, 8, device=device))
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if not bool(torch.isfinite(out).all()):
            return f"a TransformerEngine RMSNorm on {device} gave non-finite values"
    except Exception as exc:  # noqa: BLE001
        return f"a TransformerEngine RMSNorm on {device} failed ({_one_line(exc)})"
    return None


@functools.cache
def transformer_engine_status() -> tuple[bool, str]:
    """(usable, why): TE imports and runs on this process's CUDA device; probed once (no CUDA:
    False without importing TE). A failure is logged once, as one line."""
    import torch

    if not torch.cuda.is_available():
        return False, "no CUDA device"
    if not have_transformer_engine():
        return False, "TransformerEngine is not installed"
    reason = probe_transformer_engine(f"cuda:{torch.cuda.current_device()}")
    if reason is not None:
        logging.getLogger(__name__).warning("TransformerEngine not used: %s", reason)
        return False, reason
    return True, "TransformerEngine loads and runs"


def transformer_engine_usable() -> bool:
    """Whether the specs use TE (``transformer_engine_status``)."""
    return transformer_engine_status()[0]


#: The compiled softmax kernels megatron-core's ``FusedScaleMaskSoftmax`` imports (apex builds
#: them; TransformerEngine's attention does not use them).
FUSED_SOFTMAX_KERNELS = ("scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda",
                         "scaled_softmax_cuda")


@functools.cache
def fused_softmax_available() -> bool:
    """Whether megatron-core's fused attention softmax can run here: CUDA, and its compiled kernels
    import.

    NOTE: with ``masked_softmax_fusion`` set, megatron-core's ``FusedScaleMaskSoftmax`` imports
    ``scaled_masked_softmax_cuda`` at the first bf16/fp16 forward of qualifying shapes: without
    those kernels (no apex built with them) that forward fails.
    """
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        for name in FUSED_SOFTMAX_KERNELS:
            importlib.import_module(name)
    except ImportError:
        return False
    return True


def runtime_summary() -> str:
    """One line saying which device and optional kernels this run uses."""
    import torch

    if torch.cuda.is_available():
        device = f"cuda ({torch.cuda.get_device_name()}), NCCL"
    else:
        device = "cpu, gloo"
    usable, why = transformer_engine_status()
    te = "yes" if usable else f"no ({why})"
    apex = "yes" if have_nvidia_apex() and torch.cuda.is_available() else "no"
    return f"device: {device}; TransformerEngine: {te}; NVIDIA apex: {apex}"


#: megatron-core 0.16.1 (transformer_layer.py) logs this once per layer for an MLP spec that is
#: not MoELayer or MLP itself: the AoE layer (an MoELayer subclass) fetches its process groups
#: itself (layer.py), so the "default kwargs" it announces are what it expects.
UNKNOWN_MLP_TYPE = ("Unknown MLP type: <class 'megatron.core.transformer.spec_utils.ModuleSpec'>. "
                    "Using default kwargs.")


#: megatron-core 0.19.2's deprecation lines about choices aoe-megatron makes, not its users
#: (logger -> the message's start), printed on every run otherwise: the GPT model we build is its
#: GPTModel (HybridModel is its successor), and checkpoints are saved asynchronously by its own
#: writer (NVIDIA Resiliency Extension's is the successor; not in NGC's PyTorch images).
UPSTREAM_DEPRECATIONS = {
    "megatron.core.models.gpt.gpt_model": "GPTModel IS DEPRECATED",
    "megatron.core.dist_checkpointing.strategies.torch": "MCore's async save is deprecated",
}


class _DropExactly(logging.Filter):
    def __init__(self, message: str):
        super().__init__()
        self.message = message

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != self.message


class _DropStarting(_DropExactly):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.message)


def fallback_note() -> str | None:
    """One line saying which optional kernels are missing and what that costs (None: none is)."""
    import torch

    te_ok = transformer_engine_usable() if torch.cuda.is_available() else have_transformer_engine()
    missing = [name for name, ok in (("TransformerEngine", te_ok),
                                     ("NVIDIA apex", have_nvidia_apex())) if not ok]
    if not missing:
        return None
    cost = ("expected on CPU" if not torch.cuda.is_available()
            else "fused attention, norms and grouped GEMMs are slower")
    return f"no {', no '.join(missing)}: using PyTorch kernels ({cost})"


_said_fallback = False


def say_fallback_once() -> None:
    """Print ``fallback_note`` once per process, as ``[rank N] ...`` (the one line that replaces
    megatron-core's import-time warnings); ``init_megatron`` calls it."""
    global _said_fallback
    if _said_fallback:
        return
    _said_fallback = True
    if (note := fallback_note()) is not None:
        import os

        print(f"[rank {os.environ.get('RANK', '0')}] {note}", flush=True)


def _quiet_without_cuda(run_module):
    """megatron.core's loader, first dropping its import-time warnings about missing TE and
    apex where CUDA is absent (torch loads here anyway: megatron-core imports it)."""
    def exec_module(module):
        import torch

        if not torch.cuda.is_available():
            warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
        run_module(module)
    return exec_module


def quiet_cpu_fallback_warnings() -> None:
    """Without CUDA, megatron-core warns on import that TE and apex are missing: expected here
    (``say_fallback_once`` says it in one line). Drops exactly megatron-core's per-layer
    UNKNOWN_MLP_TYPE, its warning about a cuda_graph_scope default we never set, and its
    deprecation lines about our own choices (``UPSTREAM_DEPRECATIONS``). Called by
    ``import aoe_megatron``, before any megatron-core module is imported.

    NOTE: whether CUDA is there is asked as ``megatron.core`` loads (an import hook), not here:
    ``import aoe_megatron`` does not import torch, so ``--help`` stays quick."""
    from aoe_megatron.patches._patching import (  # deferred: __init__ runs this before patches
        when_loading)

    warnings.filterwarnings("ignore", message="full scope is deprecated")
    if "megatron.core" in sys.modules:  # loaded before aoe_megatron: decide now
        _quiet_without_cuda(lambda module: None)(None)
    else:
        when_loading("megatron.core", _quiet_without_cuda)
    # torch's CUDA build on a machine without CUDA, when megatron-core imports cpp_extension (a
    # machine with CUDA never logs this line)
    extension_logger = logging.getLogger("torch.utils.cpp_extension")
    if not any(isinstance(f, _DropExactly) for f in extension_logger.filters):
        extension_logger.addFilter(_DropStarting("No CUDA runtime is found"))
    layer_logger = logging.getLogger("megatron.core.transformer.transformer_layer")
    if not any(isinstance(f, _DropExactly) for f in layer_logger.filters):
        layer_logger.addFilter(_DropExactly(UNKNOWN_MLP_TYPE))
    for name, start in UPSTREAM_DEPRECATIONS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropStarting) and f.message == start for f in logger.filters):
            logger.addFilter(_DropStarting(start))
