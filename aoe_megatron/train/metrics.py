"""What a training step reports: AoE selection statistics per layer, TensorBoard, console."""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist



def selection_stats(model) -> dict:
    """Per AoE layer, averaged over data-parallel ranks: load fractions f_i (Eq. 7's), Ent_load,
    Ent_conf (Eq. 8), each expert's mean activation norm (the paper's Figure 4), L_aux."""
    from aoe_megatron.router import AoERouter

    routers = [m for m in model.modules() if isinstance(m, AoERouter)]
    if not routers:
        return {}
    packed = torch.stack([torch.cat([r.last_load.float(), r.last_mean_norm.float(),
                                     r.last_ent_conf.float().view(1),
                                     r.last_aux_loss.float().view(1)]) for r in routers])
    if dist.is_initialized():
        dist.all_reduce(packed)
        packed /= dist.get_world_size()
    e = routers[0].aoe.num_experts
    stats = {}
    for r, row in zip(routers, packed):
        layer = r.layer_number
        load = row[:e].double()
        stats[layer] = {
            "load": load.tolist(),
            "mean_norm": row[e : 2 * e].tolist(),
            "ent_conf": row[2 * e].item(),
            "aux_loss": row[2 * e + 1].item(),
            "ent_load": -(load * torch.log(load.clamp_min(1e-30))).sum().item(),
        }
    return stats


class Reporter:
    """TensorBoard scalars and a console progress line (rank 0 only)."""

    def __init__(self, run_dir, *, total_steps: int, tokens_per_step: int, enabled: bool):
        self.enabled = enabled
        self.total_steps, self.tokens_per_step = total_steps, tokens_per_step
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(run_dir))
        self.t_last = time.perf_counter()
        self.steps_since = 0

    def step(self, step: int, *, loss: float, lr: float, grad_norm, stats: dict,
             aux_loss: float | None, console: bool) -> None:
        self.steps_since += 1
        if not self.enabled:
            return
        w = self.writer
        w.add_scalar("train/loss", loss, step)
        w.add_scalar("train/lr", lr, step)
        if grad_norm is not None:
            w.add_scalar("train/grad_norm", float(grad_norm), step)
        if aux_loss is not None:
            w.add_scalar("train/aux_loss", aux_loss, step)
        for layer, s in stats.items():
            w.add_scalar(f"ent_load/layer_{layer:02d}", s["ent_load"], step)
            w.add_scalar(f"ent_conf/layer_{layer:02d}", s["ent_conf"], step)
            for i, (f, n) in enumerate(zip(s["load"], s["mean_norm"])):
                w.add_scalar(f"expert_load/layer_{layer:02d}/expert_{i}", f, step)
                w.add_scalar(f"expert_norm/layer_{layer:02d}/expert_{i}", n, step)
        if console:
            now = time.perf_counter()
            dt = (now - self.t_last) / max(self.steps_since, 1)
            tps = self.tokens_per_step / max(dt, 1e-9)
            w.add_scalar("train/tokens_per_s", tps, step)
            eta = dt * (self.total_steps - step)
            print(f"step {step:>7}/{self.total_steps}  loss {loss:.4f}  lr {lr:.3e}  "
                  f"{tps:,.0f} tokens/s  ETA {eta / 60:.1f} min", file=sys.stdout, flush=True)
            self.t_last, self.steps_since = now, 0

    def scalar(self, name: str, value: float, step: int) -> None:
        if self.enabled:
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
