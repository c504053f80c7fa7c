"""What a training step reports: AoE selection statistics per layer, and the ``Reporter`` that
writes the figures to TensorBoard, ``metrics.jsonl`` in the run directory (one JSON object a line,
for analysis tools: aoe-study), Weights & Biases (``wandb_sink``, optional) and the console
(``console``).

metrics.jsonl lines: ``{"kind": "train", "step", "loss", "lr", "grad_norm", "aux_loss", "tokens",
"skipped", "layers": {layer: {"ent_load", "ent_conf", "load": [f_i]}}}`` (``tokens``: tokens
consumed by the end of the step, step x global batch x sequence length; ``skipped``: the run's
non-finite steps skipped so far). Logging steps (``--log-interval``) add ``"ms_per_step"``,
``"tokens_per_s"`` (both over the steps since the last logging step) and ``"memory_bytes"`` (the
GPU's peak allocated memory, or the host resident size: ``memory``), and fill ``layers`` (over the
tokens of every training micro-batch since the last logging step, summed as they pass:
``moe/selection_stats.py``; its all-reduce is skipped on the others, where it is empty). With an expert bias also
``"bias_tokens"``: each biased router's selections counted in the step, over all ranks, on logging
steps. Evaluations add ``{"kind": "valid", "step", "loss"}``.
A step with a non-finite loss or gradient norm has ``{"kind": "nonfinite", "step", "action":
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
import time

import torch

from aoe_megatron.moe.selection_stats import SelectionStats
from aoe_megatron.runtime import distributed
from aoe_megatron.train import console as _console
from aoe_megatron.runtime.host_memory import resident_bytes


def _number(value):
    """JSON has no NaN or infinity: those become the strings "nan", "inf", "-inf"."""
    return value if value is None or math.isfinite(value) else str(value)


class StockRouterStats:
    """The same statistics for megatron-core's TopKRouter (the MoE baseline): load fractions from
    its routing map, Ent_conf from the softmax over all its logits (Eq. 8) and the mean logit per
    expert in place of AoE's activation norm. The logits are the ones the router computes: its
    ``routing(logits, ...)`` is wrapped on this instance (no second gating matmul; upstream's code
    is unchanged). Attaching twice reuses the first (``attach_stock_router_stats``)."""

    def __init__(self, router):
        self.router = router
        self.num_experts = router.config.num_moe_experts
        self.selection_stats = SelectionStats(self.num_experts)
        upstream = router.routing

        def routing(logits, *args, **kwargs):
            probs, routing_map = upstream(logits, *args, **kwargs)
            flat = logits.detach().reshape(-1, self.num_experts).float()
            self.selection_stats.add(routing_map.reshape(-1, self.num_experts),
                                     torch.softmax(flat, dim=-1), flat)
            return probs, routing_map

        router.routing = routing
        router.aoe_stock_stats = self

    @property
    def layer_number(self):
        return self.router.layer_number


def attach_stock_router_stats(model) -> list:
    from megatron.core.transformer.moe.router import TopKRouter

    return [getattr(m, "aoe_stock_stats", None) or StockRouterStats(m)
            for m in model.modules() if isinstance(m, TopKRouter)]


def _stat_sources(model, stock_stats) -> list:
    from aoe_megatron.moe.router import SelectionRouter  # deferred: megatron-core loads at build

    return [m for m in model.modules() if isinstance(m, SelectionRouter)] or list(stock_stats)


def reset_selection_stats(model, stock_stats=()) -> None:
    """Forget the selection statistics gathered so far (after an evaluation's forwards, say)."""
    for source in _stat_sources(model, stock_stats):
        source.selection_stats.reset()


def selection_stats(model, stock_stats=()) -> dict:
    """Per MoE layer, over the tokens of every forward since the last call (then reset), averaged
    over data-parallel ranks: load fractions f_i (Eq. 7's), Ent_load, Ent_conf (Eq. 8), each
    expert's mean activation norm (AoE; the paper's Figure 4) or mean router logit (stock MoE),
    and L_aux (the mean over training micro-batches). Collective: every rank calls it."""
    routers = _stat_sources(model, stock_stats)
    if not routers:
        return {}
    device = distributed.comm_device()
    packed = torch.stack([r.selection_stats.figures().float().to(device) for r in routers])
    for r in routers:
        r.selection_stats.reset()
    packed = distributed.reduce_across_ranks(packed, op="mean").cpu()
    e = routers[0].selection_stats.num_experts
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


def memory() -> tuple:
    """(bytes, what): the GPU's peak allocated memory of this process, else its host resident
    size (``VmRSS``: the high-water mark is reset around checkpoint saves, ``host_memory``)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated(), "GPU max allocated"

    return resident_bytes(), "host RSS"


class Reporter:
    """TensorBoard, metrics.jsonl, Weights & Biases (``wandb_sink``, optional) and the console
    (rank 0 only; the others keep the step count for the timing)."""

    def __init__(self, run_dir, *, total_steps: int, tokens_per_step: int, enabled: bool,
                 tensorboard_dir=None, wandb=None):
        """TensorBoard's files go in ``tensorboard_dir`` (``--tensorboard-dir``), else the run
        directory; ``wandb``: a ``wandb_sink.WandbSink`` or None."""
        self.enabled, self.wandb = enabled, wandb
        self.total_steps, self.tokens_per_step = total_steps, tokens_per_step
        self.writer = self.jsonl = None
        if enabled:
            from pathlib import Path

            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(tensorboard_dir or run_dir))
            self.jsonl = open(Path(run_dir) / "metrics.jsonl", "a", encoding="utf-8")
        self.t_last = time.perf_counter()
        self.steps_since = 0

    def start(self, record: dict, lines: list) -> None:
        """The run's start: ``lines`` on the console (arguments, parameters, layout) and the
        resolved arguments (``record``: config.json) as TensorBoard text, a JSON code block."""
        if not self.enabled:
            return
        for line in lines:
            _console.say(line)
        text = json.dumps(record, indent=2, default=str)
        self.writer.add_text("config", f"```json\n{text}\n```", 0)
        self.writer.flush()

    def _scalar(self, name: str, value, step: int) -> None:
        self.writer.add_scalar(name, value, step)
        if self.wandb is not None:
            self.wandb.scalar(name, value, step)

    def step(self, step: int, *, loss: float, lr: float, grad_norm, stats: dict,
             aux_loss: float | None, console: bool, bias_tokens: list | None = None,
             skipped: int = 0) -> None:
        """Step ``step`` (from 1, over the whole run: a resumed run's continue), ``skipped`` the
        run's steps skipped so far (``faults``). Tokens consumed: ``step x tokens_per_step``."""
        self.steps_since += 1
        if not self.enabled:
            return
        tokens = step * self.tokens_per_step
        self._scalar("train/loss", loss, step)
        self._scalar("train/lr", lr, step)
        if grad_norm is not None:
            self._scalar("train/grad_norm", float(grad_norm), step)
        if aux_loss is not None:
            self._scalar("train/aux_loss", aux_loss, step)
        self._scalar("train/tokens", tokens, step)
        self._scalar("train/skipped_steps", skipped, step)
        record = {"kind": "train", "step": step, "loss": loss, "lr": lr,
                  "grad_norm": None if grad_norm is None else float(grad_norm),
                  "aux_loss": aux_loss, "tokens": tokens, "skipped": skipped}
        if bias_tokens is not None:
            record["bias_tokens"] = bias_tokens
        if console:
            now = time.perf_counter()
            dt = (now - self.t_last) / max(self.steps_since, 1)
            tps = self.tokens_per_step / max(dt, 1e-9)
            nbytes, what = memory()
            self._scalar("train/tokens_per_s", tps, step)
            self._scalar("train/ms_per_step", dt * 1e3, step)
            if nbytes is not None:
                self._scalar("train/memory_GiB", nbytes / 2**30, step)
            record.update(ms_per_step=dt * 1e3, tokens_per_s=tps, memory_bytes=nbytes)
            said = "unknown" if nbytes is None else f"{nbytes / 2**30:.2f} GiB ({what})"
            _console.say(_console.step_line(
                step=step, total=self.total_steps, loss=loss, lr=lr, grad_norm=grad_norm,
                ms_per_step=dt * 1e3, tokens_per_s=tps, tokens=tokens, skipped=skipped,
                memory=said, eta_s=dt * (self.total_steps - step)))
            self.t_last, self.steps_since = now, 0
        record["layers"] = {str(layer): {"ent_load": s["ent_load"], "ent_conf": s["ent_conf"],
                                         "load": s["load"]} for layer, s in stats.items()}
        self._line(record)
        for layer, s in stats.items():
            self._scalar(f"ent_load/layer_{layer:02d}", s["ent_load"], step)
            self._scalar(f"ent_conf/layer_{layer:02d}", s["ent_conf"], step)
            for i, (f, n) in enumerate(zip(s["load"], s["mean_norm"])):
                self._scalar(f"expert_load/layer_{layer:02d}/expert_{i}", f, step)
                self._scalar(f"expert_norm/layer_{layer:02d}/expert_{i}", n, step)

    def nonfinite(self, verdict) -> None:
        """A step with a non-finite loss or gradient norm (``faults.Verdict``), skipped or stopping
        the run: a console line when skipped (a stop is the run's error message), TensorBoard's
        count of skipped steps, and a metrics.jsonl line in place of the train line (non-finite
        numbers as strings: the file stays strict JSON)."""
        if not self.enabled:
            return
        if not verdict.stopped:
            _console.say(verdict.message)
        self._scalar("train/nonfinite_skipped", verdict.skipped, verdict.step)
        self._line({"kind": "nonfinite", "step": verdict.step,
                    "action": "stopped" if verdict.stopped else "skipped",
                    "loss": _number(verdict.loss), "grad_norm": _number(verdict.grad_norm),
                    "skipped": verdict.skipped, "limit": verdict.limit})

    def save(self, step: int, *, seconds: float, nbytes, window, needed: float) -> None:
        """A checkpoint saved: its seconds and bytes, against the stop window (``stop_window``)."""
        if not self.enabled:
            return
        rate = nbytes / seconds if nbytes and seconds > 0 else None
        self._scalar("checkpoint/save_seconds", seconds, step)
        if rate is not None:
            self._scalar("checkpoint/save_GB_per_s", rate / 1e9, step)
        self._line({"kind": "save", "step": step, "seconds": round(seconds, 3), "bytes": nbytes,
                    "bytes_per_s": None if rate is None else round(rate), "stop_window_s": window,
                    "needed_s": round(needed, 1)})

    def scalar(self, name: str, value: float, step: int) -> None:
        if self.enabled:
            self._scalar(name, value, step)
            if name == "valid/loss":
                self._line({"kind": "valid", "step": step, "loss": value})

    def _line(self, record: dict) -> None:
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.close()
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
        if self.jsonl is not None:
            self.jsonl.close()
