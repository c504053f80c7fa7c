"""What a training step reports: AoE selection statistics per layer, TensorBoard, console, and
``metrics.jsonl`` in the run directory (one JSON object a line, for analysis tools: aoe-study).

metrics.jsonl lines: ``{"kind": "train", "step", "loss", "lr", "grad_norm", "aux_loss", "layers":
{layer: {"ent_load", "ent_conf", "load": [f_i]}}}`` (with an expert bias also ``"bias_tokens"``:
each biased router's selections counted in the step, over all ranks, on logging steps) and
``{"kind": "valid", "step", "loss"}``.
``layers`` is filled on logging steps only (``--log-interval``; its all-reduce is skipped on
the others) and empty on the rest. A step with a non-finite loss or gradient norm has ``{"kind": "nonfinite", "step", "action":
"skipped"|"stopped", "loss", "grad_norm", "skipped", "limit"}`` instead of its train line.
Each checkpoint saved adds ``{"kind": "save", "step", "seconds", "bytes", "bytes_per_s",
"stop_window_s", "needed_s"}`` (``train/stop_window.py``; the window None where unknown).
A resumed run appends: a step logged twice (before and after a restart) keeps its last line. A run
that resumes no checkpoint starts a file of its own (an earlier run's is moved aside first:
``train/run_dir.py``).
"""

from __future__ import annotations

import json
import math
import sys
import time

import torch

from aoe_megatron.moe import ops


def _number(value):
    """JSON has no NaN or infinity: those become the strings "nan", "inf", "-inf"."""
    return value if value is None or math.isfinite(value) else str(value)


class StockRouterStats:
    """The same statistics for megatron-core's TopKRouter (the MoE baseline), from a forward hook:
    load fractions from the routing map, Ent_conf from the softmax over all router logits (Eq. 8),
    and the mean router logit per expert in place of AoE's activation norm."""

    def __init__(self, router):
        self.router = router
        e = router.config.num_moe_experts
        self.last_load = torch.zeros(e)
        self.last_mean_norm = torch.zeros(e)
        self.last_ent_conf = torch.zeros(())
        self.last_aux_loss = torch.zeros(())
        self.layer_number = router.layer_number
        self.num_experts = e
        router.register_forward_hook(self._hook)

    @torch.no_grad()
    def _hook(self, module, inputs, output):
        _, routing_map = output
        x = inputs[0].reshape(-1, inputs[0].shape[-1])
        logits = module.gating(x).float()  # the router's own logits (fp32: moe_router_dtype)
        # NOTE: kept on the router's device (no host sync per forward); selection_stats moves them
        self.last_load = ops.load_fractions(routing_map.reshape(-1, self.num_experts)).float()
        self.last_ent_conf = ops.confidence_entropy(torch.softmax(logits, dim=-1)).float()
        self.last_mean_norm = logits.mean(0).float()
        self.layer_number = module.layer_number


def attach_stock_router_stats(model) -> list:
    from megatron.core.transformer.moe.router import TopKRouter

    return [StockRouterStats(m) for m in model.modules() if isinstance(m, TopKRouter)]


def selection_stats(model, stock_stats=()) -> dict:
    """Per MoE layer, averaged over data-parallel ranks: load fractions f_i (Eq. 7's), Ent_load,
    Ent_conf (Eq. 8), each expert's mean activation norm (AoE; the paper's Figure 4) or mean
    router logit (stock MoE), and L_aux (AoE)."""
    from aoe_megatron.runtime.distributed import comm_device, reduce_across_ranks
    from aoe_megatron.moe.router import SelectionRouter

    routers = [m for m in model.modules() if isinstance(m, SelectionRouter)] or list(stock_stats)
    if not routers:
        return {}
    device = comm_device()
    packed = torch.stack([torch.cat([t.detach().float().to(device).view(-1) for t in (
        r.last_load, r.last_mean_norm, r.last_ent_conf, r.last_aux_loss)]) for r in routers])
    packed = reduce_across_ranks(packed, op="mean").cpu()
    e = routers[0].last_load.numel()
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
    """TensorBoard scalars, metrics.jsonl and a console progress line (rank 0 only)."""

    def __init__(self, run_dir, *, total_steps: int, tokens_per_step: int, enabled: bool):
        self.enabled = enabled
        self.total_steps, self.tokens_per_step = total_steps, tokens_per_step
        self.writer = self.jsonl = None
        if enabled:
            from pathlib import Path

            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(run_dir))
            self.jsonl = open(Path(run_dir) / "metrics.jsonl", "a", encoding="utf-8")
        self.t_last = time.perf_counter()
        self.steps_since = 0

    def step(self, step: int, *, loss: float, lr: float, grad_norm, stats: dict,
             aux_loss: float | None, console: bool, bias_tokens: list | None = None) -> None:
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
        self._line({"kind": "train", "step": step, "loss": loss, "lr": lr,
                    "grad_norm": None if grad_norm is None else float(grad_norm),
                    "aux_loss": aux_loss,
                    **({} if bias_tokens is None else {"bias_tokens": bias_tokens}),
                    "layers": {str(layer): {"ent_load": s["ent_load"], "ent_conf": s["ent_conf"],
                                            "load": s["load"]} for layer, s in stats.items()}})
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

    def nonfinite(self, verdict) -> None:
        """``layers`` is filled on logging steps only (``--log-interval``; its all-reduce is skipped on
the others) and empty on the rest. A step with a non-finite loss or gradient norm (``faults.Verdict``), skipped or stopping
        the run: a console line when skipped (a stop is the run's error message), TensorBoard's
        count of skipped steps, and a metrics.jsonl line in place of the train line (non-finite
        numbers as strings: the file stays strict JSON)."""
        if not self.enabled:
            return
        if not verdict.stopped:
            print(verdict.message, file=sys.stdout, flush=True)
        self.writer.add_scalar("train/nonfinite_skipped", verdict.skipped, verdict.step)
        self._line({"kind": "nonfinite", "step": verdict.step,
                    "action": "stopped" if verdict.stopped else "skipped",
                    "loss": _number(verdict.loss), "grad_norm": _number(verdict.grad_norm),
                    "skipped": verdict.skipped, "limit": verdict.limit})

    def save(self, step: int, *, seconds: float, nbytes, window, needed: float) -> None:
        """A checkpoint saved: its seconds and bytes, against the stop window (``stop_window``)."""
        if not self.enabled:
            return
        rate = nbytes / seconds if nbytes and seconds > 0 else None
        self.writer.add_scalar("checkpoint/save_seconds", seconds, step)
        if rate is not None:
            self.writer.add_scalar("checkpoint/save_GB_per_s", rate / 1e9, step)
        self._line({"kind": "save", "step": step, "seconds": round(seconds, 3), "bytes": nbytes,
                    "bytes_per_s": None if rate is None else round(rate), "stop_window_s": window,
                    "needed_s": round(needed, 1)})

    def scalar(self, name: str, value: float, step: int) -> None:
        if self.enabled:
            self.writer.add_scalar(name, value, step)
            if name == "valid/loss":
                self._line({"kind": "valid", "step": step, "loss": value})

    def _line(self, record: dict) -> None:
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
        if self.jsonl is not None:
            self.jsonl.close()
