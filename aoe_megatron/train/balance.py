"""Aux-loss-free balancing under our loop (DeepSeek-V3's expert bias; ``ModelConfig.expert_bias``).

megatron-core updates its routers' ``expert_bias`` in ``finalize_model_grads``, which the DeepSpeed
loop never calls. Here every router holding an ``expert_bias`` (the stock ``PaperTopKRouter``, AoE's
router) counts its training forwards' tokens per expert in ``local_tokens_per_expert``; the step's
counts join the step's one all-reduce (``step.agree_on_step``), and every rank then moves every
bias by the same ``moe.ops.updated_expert_bias``. A skipped step (non-finite loss) leaves the
biases as they were, as it leaves the weights.
"""

from __future__ import annotations

from typing import Optional

import torch

from aoe_megatron.moe.ops import updated_expert_bias


def biased_routers(model) -> list:
    """The modules of ``model`` that hold an expert bias, in a fixed order."""
    return [m for m in model.modules() if isinstance(getattr(m, "expert_bias", None), torch.Tensor)]


def step_loads(routers: list) -> Optional[torch.Tensor]:
    """This rank's token counts of the step, every router's concatenated (None without routers)."""
    if not routers:
        return None
    return torch.cat([r.local_tokens_per_expert.float() for r in routers])


def update_biases(routers: list, loads: Optional[torch.Tensor], *, applied: bool) -> None:
    """Move each router's bias toward balance by its ``bias_update_rate`` from ``loads`` (the
    step's counts summed over ranks, ``step_loads``' layout) when the step was applied; clear the
    counts either way."""
    offset = 0
    with torch.no_grad():
        for router in routers:
            n = router.expert_bias.numel()
            if applied:
                router.expert_bias.copy_(updated_expert_bias(
                    router.expert_bias, loads[offset:offset + n].to(router.expert_bias.device),
                    router.bias_update_rate))
            router.local_tokens_per_expert.zero_()
            offset += n
