"""A DeepSpeed engine around a megatron-core GPTModel with expert parallelism.

DeepSpeed treats a parameter as an expert's only when ``param.allreduce`` is False, it carries
``param.group_name == "ep_size_<EP>"`` and the model contains a ``deepspeed.moe.layer.MoE``;
it then reduces it over the expert-data-parallel group registered under that name. We register
megatron-core's own expert and expert-data-parallel groups there, mark the expert weights, and
attach a parameter-less MoE marker (DeepSpeed 0.19: ``engine.has_moe_layers`` looks for a ``MoE``
module; ``moe/utils.py`` splits optimizer groups by ``group_name``). Dense weights are reduced over
the full data-parallel group. ZeRO-3 is refused with EP > 1 (DeepSpeed would mix experts).
"""

from __future__ import annotations

import json
import os

import torch

from aoe_megatron.patches import apply_deepspeed_patches
from aoe_megatron.runtime import resources

DEEPSPEED_CONFIGS = resources.path("deepspeed")


def import_deepspeed():
    """DeepSpeed, with its CPU accelerator selected when CUDA is absent, and patched
    (``patches/deepspeed_*``)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    apply_deepspeed_patches()

    return deepspeed


GRAD_ACCUM_DTYPES = ("fp32", "bf16")


def load_zero_config(stage: int, *, micro_batch: int, grad_accum: int, dp_size: int,
                     bf16: bool, grad_accum_dtype: str = "fp32") -> dict:
    """DeepSpeed's config for ZeRO ``stage``.

    bf16 runs accumulate gradients over the micro-batches, and reduce them across ranks, in
    ``grad_accum_dtype``: fp32 by default, as Megatron-LM does (64 to 128 bf16 additions per step
    would otherwise round away small gradients). With fp32, DeepSpeed runs ZeRO-1 as its
    ``BF16_Optimizer`` and ZeRO-2/3 with fp32 gradient partitions.
    """
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
    if grad_accum_dtype not in GRAD_ACCUM_DTYPES:
        raise ValueError(f"grad_accum_dtype must be one of {GRAD_ACCUM_DTYPES}, got "
                         f"{grad_accum_dtype!r}")
    path = DEEPSPEED_CONFIGS / f"zero{max(stage, 1)}.json"
    cfg = json.loads(path.read_text())
    cfg["zero_optimization"]["stage"] = stage
    cfg["train_micro_batch_size_per_gpu"] = micro_batch
    cfg["gradient_accumulation_steps"] = grad_accum
    # NOTE: DeepSpeed's data-parallel size is the world size (EP ranks are DP ranks too).
    cfg["train_batch_size"] = micro_batch * grad_accum * dp_size
    cfg["bf16"] = {"enabled": bool(bf16)}
    if bf16:
        cfg["data_types"] = {"grad_accum_dtype": grad_accum_dtype}
        cfg["communication_data_type"] = grad_accum_dtype
    return cfg


def check_zero_and_ep(stage: int, ep_size: int) -> None:
    if stage == 3 and ep_size > 1:
        raise ValueError(
            "ZeRO-3 with expert parallelism (EP > 1) is not supported: DeepSpeed would shard and "
            "mix different ranks' experts. Use ZeRO-1 or ZeRO-2 with EP > 1, or EP = 1 with ZeRO-3."
        )


def _expert_marker_class():
    from deepspeed.moe.layer import MoE

    class ExpertParallelMarker(MoE):
        """Tells DeepSpeed the model has expert-parallel weights; holds no parameters."""

        def __init__(self, num_experts: int, ep_size: int):
            torch.nn.Module.__init__(self)
            self.num_experts = num_experts
            self.ep_size = ep_size
            self.expert_group_name = f"ep_size_{ep_size}"
            self.num_local_experts = num_experts // ep_size

        def set_deepspeed_parallelism(self, *args, **kwargs) -> None:
            """Groups are megatron-core's, registered by prepare_experts_for_deepspeed."""

        def forward(self, *args, **kwargs):  # pragma: no cover - never called
            raise RuntimeError("the expert-parallel marker is not a layer")

    return ExpertParallelMarker


def prepare_experts_for_deepspeed(model: torch.nn.Module, *, num_experts: int, ep_size: int) -> int:
    """Mark expert weights and register megatron-core's EP groups with DeepSpeed.

    Returns the number of expert parameters marked. At EP = 1 nothing is needed: every weight is
    an ordinary data-parallel weight.
    """
    if ep_size == 1:
        return 0
    import torch.distributed as dist
    from deepspeed.utils import groups
    from megatron.core import parallel_state

    name = f"ep_size_{ep_size}"
    ep_group = parallel_state.get_expert_model_parallel_group()
    edp_group = parallel_state.get_expert_data_parallel_group()
    groups._EXPERT_PARALLEL_GROUP[name] = ep_group
    groups._EXPERT_PARALLEL_GROUP_RANKS[name] = dist.get_process_group_ranks(ep_group)
    groups._EXPERT_DATA_PARALLEL_GROUP[name] = edp_group
    groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = dist.get_process_group_ranks(edp_group)
    marked = 0
    for param in model.parameters():
        if getattr(param, "allreduce", True) is False:
            param.group_name = name
            marked += 1
    if marked == 0:
        raise RuntimeError("EP > 1 but no expert weight carries allreduce=False")
    model.add_module("deepspeed_expert_marker", _expert_marker_class()(num_experts, ep_size))
    return marked


def optimizer_param_groups(model: torch.nn.Module, *, weight_decay: float) -> list:
    """AdamW groups: no decay on norms and 1-D weights; experts split out for DeepSpeed."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 or "norm" in name else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]
    # NOTE: no empty group: DeepSpeed's BF16_Optimizer drops it, and the LR scheduler, built on
    # the groups given here, then fails at its first step (more groups than the optimizer has).
    groups = [g for g in groups if g["params"]]
    return split_params_into_different_moe_groups_for_optimizer(groups)


def build_engine(model, *, zero_stage: int, lr: float, betas=(0.9, 0.95), weight_decay=0.1,
                 eps=1e-8, lr_schedule=None, micro_batch: int, grad_accum: int, ep_size: int,
                 num_experts: int, bf16: bool = False, grad_accum_dtype: str = "fp32",
                 clip_grad: float = 1.0):
    """(engine, optimizer, scheduler) for ``model`` under ZeRO ``zero_stage``."""
    import torch.distributed as dist

    check_zero_and_ep(zero_stage, ep_size)
    deepspeed = import_deepspeed()
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    prepare_experts_for_deepspeed(model, num_experts=num_experts, ep_size=ep_size)
    optimizer = torch.optim.AdamW(optimizer_param_groups(model, weight_decay=weight_decay),
                                  lr=lr, betas=betas, eps=eps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule or (lambda _: 1.0))
    config = load_zero_config(zero_stage, micro_batch=micro_batch, grad_accum=grad_accum,
                              dp_size=dist.get_world_size(), bf16=bf16,
                              grad_accum_dtype=grad_accum_dtype)
    config["gradient_clipping"] = clip_grad
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config,
    )
    return engine, optimizer, scheduler
