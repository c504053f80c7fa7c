"""Checkpoints that survive preemption and any expert-parallel layout.

A checkpoint is a directory ``step_00000100/``:
  model/            megatron-core distributed checkpoint of the GPTModel (experts as slices of
                    global tensors: loadable at any EP size)
  optim_rank{r}.pt  rank r's ZeRO-1/2 optimizer partition (tensors, lists, numbers only:
                    read back with ``torch.load(weights_only=True)``)
  state.json        step, consumed samples, layout (world size, EP, ZeRO stage), config
It is written as ``step_N.partial-*`` and renamed when complete on every rank; then ``latest``
(a one-line file) is replaced atomically. A crash at any point leaves the previous checkpoint and
``latest`` untouched.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

LATEST = "latest"


def _name(step: int) -> str:
    return f"step_{step:08d}"


def latest_checkpoint(ckpt_dir) -> Optional[Path]:
    path = Path(ckpt_dir) / LATEST
    if not path.is_file():
        return None
    target = Path(ckpt_dir) / path.read_text().strip()
    if not (target / "state.json").is_file():
        raise FileNotFoundError(f"{path} names {target}, which is not a complete checkpoint")
    return target


def _optimizer_state(engine) -> dict:
    opt = engine.optimizer
    if not hasattr(opt, "single_partition_of_fp32_groups"):
        raise NotImplementedError("checkpoints support ZeRO-1 and ZeRO-2 optimizers")
    return {
        "fp32_partitions": [t.detach().clone() for t in opt.single_partition_of_fp32_groups],
        "base_optimizer": opt.optimizer.state_dict(),
    }


def _restore_optimizer(engine, state: dict) -> None:
    opt = engine.optimizer
    for mine, saved in zip(opt.single_partition_of_fp32_groups, state["fp32_partitions"], strict=True):
        if mine.shape != saved.shape:
            raise ValueError("the optimizer partition layout differs from the checkpoint's")
        mine.data.copy_(saved)
    opt.optimizer.load_state_dict(state["base_optimizer"])
    opt.update_lp_params()  # model weights from the fp32 master partitions


def save_checkpoint(ckpt_dir, *, step: int, engine, model, scheduler, consumed_samples: int,
                    layout: dict, config: dict, extra: Optional[dict] = None) -> Path:
    """Write a checkpoint collectively (every rank calls this); returns its directory."""
    from megatron.core import dist_checkpointing

    rank = dist.get_rank()
    root = Path(ckpt_dir)
    final = root / _name(step)
    # Every rank uses rank 0's temporary name.
    tmp_name = [f"{_name(step)}.partial-{socket.gethostname()}-{os.getpid()}" if rank == 0 else None]
    dist.broadcast_object_list(tmp_name, src=0)
    tmp = root / tmp_name[0]
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        (tmp / "model").mkdir(parents=True)
    dist.barrier()
    try:
        dist_checkpointing.save(model.sharded_state_dict(), str(tmp / "model"))
        torch.save({**_optimizer_state(engine), "scheduler": scheduler.state_dict()},
                   tmp / f"optim_rank{rank}.pt")
    except BaseException:
        if rank == 0:  # best effort: the half-written directory is never read, but takes space
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    dist.barrier()
    if rank == 0:
        state = {"step": step, "consumed_samples": consumed_samples, "layout": layout,
                 "config": config, **(extra or {})}
        (tmp / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer = root / f"{LATEST}.partial"
        pointer.write_text(final.name + "\n")
        os.replace(pointer, root / LATEST)
    dist.barrier()
    return final


def load_checkpoint(path, *, engine, model, scheduler, layout: dict) -> dict:
    """Restore model, optimizer and scheduler; returns state.json. Same layout required."""
    from megatron.core import dist_checkpointing

    state = json.loads((Path(path) / "state.json").read_text())
    if state["layout"] != layout:
        raise ValueError(
            f"{path} was written with layout {state['layout']}, this run is {layout}: the "
            f"optimizer cannot be resumed across layouts (load the model weights only instead)"
        )
    load_model_weights(path, model)
    saved = torch.load(Path(path) / f"optim_rank{dist.get_rank()}.pt", weights_only=True)
    _restore_optimizer(engine, saved)
    scheduler.load_state_dict(saved["scheduler"])
    return state


def load_model_weights(path, model) -> None:
    """Model weights only, at any expert-parallel size."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(model.sharded_state_dict(), str(Path(path) / "model"))
    result = model.load_state_dict(loaded, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise ValueError(f"{path}: missing {missing}, unexpected {result.unexpected_keys}")
