"""Held-out evaluation of one checkpoint, in its own process (one rank, EP=1, whatever layout the
checkpoint was trained at):

    python -m aoe_megatron.study.evaluate CKPT_DIR --data run/data-study.yaml --output eval.json \\
        [--settings '{"evaluation": {"sequences": 256}, "probe": {"sequences": 32}}']

Writes the mean next-token loss and perplexity over a fixed set of validation windows (the same
windows for every run: ``evaluation.seed``), each MoE layer's per-expert load, Ent_load and
Ent_conf on those tokens, and, when ``probe`` is given, the forced-expert norm probe
(aoe_megatron.study.probe).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

from aoe_megatron.checkpoint.layout import checkpoints as kept
from aoe_megatron.checkpoint.model import load_model
from aoe_megatron.models.gpt import ModelConfig
from aoe_megatron.runtime.compat import quiet_cpu_fallback_warnings
from aoe_megatron.runtime.distributed import free_port, init_megatron, shutdown
from aoe_megatron.study import checkpoints
from aoe_megatron.study.probe import probe_step
from aoe_megatron.train.metrics import (attach_stock_router_stats, reset_selection_stats,
                                        selection_stats)

DEFAULT_EVAL = {"sequences": 256, "batch_size": 8, "seed": 0}


def open_model(ckpt, *, verify: bool = True) -> tuple:
    """(model, state) from a checkpoint (or a ckpt dir: its latest), verified first unless not
    ``verify`` (``checkpoints.open_checkpoint``), at EP=1 on this process, in a one-rank megatron
    world (started here if none is up)."""
    import torch.distributed as dist

    path, state = checkpoints.open_checkpoint(ckpt, what="the evaluation", verify=verify)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        init_megatron(rank=0, world_size=1, expert_parallel_size=1, seed=0)
    model = load_model(path)  # the settings its state record holds
    state["path"] = str(path)
    return model, state


def per_token_losses(model, windows: torch.Tensor) -> torch.Tensor:
    """Next-token losses [B, S] of ``windows`` [B, S + 1]."""
    device = next(model.parameters()).device
    inputs, labels = windows[:, :-1].to(device), windows[:, 1:].to(device)
    position_ids = torch.arange(inputs.shape[1], device=device).unsqueeze(0).expand_as(inputs)
    return model(inputs, position_ids, None, labels=labels).float()


@torch.no_grad()
def heldout_metrics(model, windows: torch.Tensor, *, batch_size: int, arch: str) -> dict:
    """Mean loss and perplexity, and per-layer selection statistics averaged over batches."""
    stock = attach_stock_router_stats(model) if arch == "moe" else []
    reset_selection_stats(model, stock)  # each batch's figures are its own (read, then reset)
    total, count, layers, batches = 0.0, 0, {}, 0
    for start in range(0, windows.shape[0], batch_size):
        losses = per_token_losses(model, windows[start:start + batch_size])
        total += losses.double().sum().item()  # every window has seq_length tokens
        count += losses.numel()
        batches += 1
        for layer, s in selection_stats(model, stock).items():
            acc = layers.setdefault(str(layer), {"load": torch.zeros(len(s["load"]), dtype=torch.float64),
                                                 "ent_conf": 0.0})
            acc["load"] += torch.tensor(s["load"], dtype=torch.float64)
            acc["ent_conf"] += s["ent_conf"]
    out_layers = {}
    for layer, acc in layers.items():
        load = acc["load"] / batches
        out_layers[layer] = {"load": load.tolist(), "ent_conf": acc["ent_conf"] / batches,
                             "ent_load": -(load * torch.log(load.clamp_min(1e-30))).sum().item()}
    loss = total / count
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": count, "layers": out_layers}


def _earlier_checkpoints(ckpt, latest: dict, windows, *, batch_size: int, arch: str,
                         verify: bool) -> dict:
    """{step: held-out metrics} of every kept checkpoint of ``ckpt``'s folder before ``latest``
    (the model of each loaded into one model object; each verified first unless not ``verify``)."""
    folder = Path(latest["path"]).parent
    cfg = ModelConfig.from_dict(latest["config"]["model"])
    curve = {}
    for step_dir in kept(folder):
        if step_dir == Path(latest["path"]):
            continue
        path, state = checkpoints.open_checkpoint(step_dir, what="the evaluation", verify=verify)
        model = load_model(path, cfg)
        curve[str(state["step"])] = heldout_metrics(model, windows, batch_size=batch_size, arch=arch)
        print(f"evaluated {path}: held-out loss {curve[str(state['step'])]['loss']:.4f}", flush=True)
    return curve


def evaluate(ckpt, data: str, settings: dict, *, verify: bool = True) -> dict:
    """Held-out metrics of ``ckpt`` (a checkpoint, or a folder's latest); with
    ``evaluation.checkpoints: all`` also of every earlier checkpoint the folder keeps, as
    ``curve`` {step: metrics} (the latest included)."""
    model, state = open_model(ckpt, verify=verify)
    cfg = state["config"]["model"]
    ev = {**DEFAULT_EVAL, **(settings.get("evaluation") or {})}
    windows = checkpoints.heldout_windows(data, seq_length=cfg["seq_length"],
                                          sequences=ev["sequences"], seed=ev["seed"])
    result = {"checkpoint": state["path"], "step": state["step"], "settings": settings,
              "heldout": heldout_metrics(model, windows, batch_size=ev["batch_size"],
                                         arch=cfg["arch"])}
    if ev.get("checkpoints") == "all":
        curve = _earlier_checkpoints(ckpt, state, windows, batch_size=ev["batch_size"],
                                     arch=cfg["arch"], verify=verify)
        curve[str(state["step"])] = result["heldout"]
        result["curve"] = dict(sorted(curve.items(), key=lambda kv: int(kv[0])))
    print(f"evaluated {state['path']}: held-out loss {result['heldout']['loss']:.4f} over "
          f"{result['heldout']['tokens']} tokens", flush=True)
    probe = settings.get("probe")
    if probe:
        n = int(probe.get("sequences", 32))  # the checkpoint verified above, not hashed again
        result["probe"] = probe_step(state["path"], state, windows[:n],
                                     batch_size=int(probe.get("batch_size", ev["batch_size"])))
        print("probe: done", flush=True)
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", help="a checkpoint, or a checkpoint directory (its latest)")
    ap.add_argument("--data", required=True, help="data config whose validation split is used")
    ap.add_argument("--output", required=True, type=Path, help="JSON file to write")
    ap.add_argument("--settings", default="{}", help="JSON: {evaluation: {...}, probe: {...}}")
    ap.add_argument("--no-verify", action="store_true",
                    help="read the checkpoint without first checking its files against its "
                         "manifest; a damaged checkpoint is otherwise refused, exit 2 (default: "
                         "off)")
    args = ap.parse_args(argv)
    quiet_cpu_fallback_warnings()
    try:
        settings = json.loads(args.settings)
        result = evaluate(args.checkpoint, args.data, settings, verify=not args.no_verify)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        shutdown()
    tmp = args.output.with_suffix(".partial")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(args.output)
    return 0


if __name__ == "__main__":
    from aoe_megatron.runtime.exit import exit_now

    exit_now(main())  # as SystemExit(main()), less a second of interpreter teardown
