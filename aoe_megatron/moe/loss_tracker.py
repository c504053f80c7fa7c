"""megatron-core's per-layer auxiliary-loss tracker (what its routers log), across releases.

megatron-core 0.18 moved it behind ``moe_logging.get_moe_metrics_tracker()``; the 0.16.1
functions (``save_to_aux_losses_tracker`` and friends) remain in 0.19.2 as deprecated wrappers of
it, to be removed. Our routers record into the same tracker as megatron-core's own, so the
training loop reads AoE's L_aux and the stock router's from one place.
"""

from __future__ import annotations

from typing import Optional

import torch

from aoe_megatron.runtime.versions import mcore_at_least


def _tracker():
    """0.18+: megatron-core's tracker object; 0.16.1: None (its module-level functions)."""
    if not mcore_at_least("0.18"):  # the release that added moe_logging
        return None
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    return get_moe_metrics_tracker()


def record(name: str, value: torch.Tensor, layer_number: int, num_layers: int) -> None:
    """Add ``value`` to loss ``name`` of layer ``layer_number`` (1-based) for this step."""
    if (tracker := _tracker()) is not None:
        tracker.record(name=name, value=value, layer_number=layer_number, num_layers=num_layers)
        return
    from megatron.core.transformer.moe.moe_utils import save_to_aux_losses_tracker

    save_to_aux_losses_tracker(name, value, layer_number, num_layers)


def layer_values(name: str) -> Optional[torch.Tensor]:
    """Loss ``name`` per layer [num_layers] since the last :func:`clear`, or None."""
    if (tracker := _tracker()) is not None:
        entry = tracker.metrics.get(name)
        return None if entry is None else entry.values
    from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

    entry = get_moe_layer_wise_logging_tracker().get(name)
    return None if entry is None else entry["values"]


def clear() -> None:
    """Zero every tracked loss (once per step, as megatron-core's training loop does)."""
    if (tracker := _tracker()) is not None:
        tracker.clear()
        return
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

    clear_aux_losses_tracker()
