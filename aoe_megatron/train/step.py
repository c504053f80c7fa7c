"""One training step: the micro-batches' forward and backward, the optimizer step, and the one
collective of the loop's own that every step makes (``agree_on_step``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from aoe_megatron.moe import loss_tracker
from aoe_megatron.runtime.distributed import reduce_across_ranks
from aoe_megatron.train.balance import step_loads, update_biases
from aoe_megatron.train.batches import lm_loss


@dataclass(frozen=True)
class StepResult:
    """What every rank knows after a step (the same on every rank)."""

    step: int
    """Numbered from 1, as logged."""
    loss: float
    """The step's loss, averaged over micro-batches and ranks."""
    lr: float
    grad_norm: Optional[float]
    """DeepSpeed's global gradient norm (None where it computed none)."""
    applied: bool
    """Whether the optimizer applied the update."""
    nonfinite_ranks: int
    """Ranks whose own loss was NaN or infinite."""
    stop: bool
    """Some rank was asked to stop (SIGTERM / SIGUSR1)."""
    aux_loss: Optional[float]
    """megatron-core's load-balancing loss (MoE baseline), on logging steps."""
    log: bool
    """A logging step: statistics are gathered and a console line printed."""
    bias_tokens: Optional[list] = None
    """Per router with an expert bias: the selections it counted this step over all ranks (with
    top-k selection, tokens x k: once per micro-batch, recomputed layers included)."""


def agree_on_step(loss: torch.Tensor, *, stop_raised: bool,
                  loads: Optional[torch.Tensor] = None) -> tuple:
    """(mean loss, ranks with a non-finite loss, whether any rank must stop), from one all-reduce
    of what every step must agree on. ``loads`` (the expert-bias update's token counts,
    ``balance.step_loads``) joins that all-reduce and is summed over ranks in place."""
    import torch.distributed as dist

    loss = loss.detach().float().reshape(())
    flags = torch.tensor([0.0, float(stop_raised)], device=loss.device)
    flags[0] = (~torch.isfinite(loss)).float()
    parts = [loss.reshape(1), flags] + ([] if loads is None else [loads.to(loss.device).float()])
    total = reduce_across_ranks(torch.cat(parts), op="sum")
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    total[0:1].div_(world)  # the mean, computed as reduce_across_ranks(op="mean") does
    if loads is not None:
        loads.copy_(total[3:])
    mean, nonfinite, stop = total[:3].tolist()  # the step's one host sync
    return mean, int(nonfinite), stop > 0


def _aux_loss(grad_accum: int) -> Optional[float]:
    values = loss_tracker.layer_values("load_balancing_loss")
    return None if values is None else float(values.sum()) / grad_accum


def train_step(parts, step: int, *, stop_flag, log: bool) -> StepResult:
    """Step ``step`` (from 0) of ``parts`` (``setup.Parts``); ``stop_flag.raised`` is read
    after the optimizer step, so a signal during the step stops the run after it."""
    engine, gas = parts.engine, parts.run.grad_accum
    lr = parts.scheduler.get_last_lr()[0]
    step_loss = 0.0  # on the model's device: no host sync per micro-batch
    for micro in range(gas):
        loss = lm_loss(engine, parts.batches.train_batch(step, micro, gas))
        loss = parts.nonfinite.inject(step + 1, loss, parts.rank)  # --inject-nonfinite (tests)
        engine.backward(loss)
        engine.step()
        step_loss = step_loss + loss.detach().float() / gas
    try:
        aux = _aux_loss(gas) if log else None
    finally:
        loss_tracker.clear()
    loads = step_loads(parts.biased_routers)
    mean, nonfinite, stop = agree_on_step(step_loss, stop_raised=stop_flag.raised, loads=loads)
    applied = engine.was_step_applied()
    bias_tokens = None
    if loads is not None and log:
        sizes = [r.expert_bias.numel() for r in parts.biased_routers]
        bias_tokens = [float(part.sum()) for part in loads.split(sizes)]
    update_biases(parts.biased_routers, loads, applied=applied)
    grad_norm = engine.get_global_grad_norm()
    return StepResult(step=step + 1, loss=mean, lr=lr,
                      grad_norm=None if grad_norm is None else float(grad_norm),
                      applied=applied, nonfinite_ranks=nonfinite, stop=stop,
                      aux_loss=aux, log=log, bias_tokens=bias_tokens)
