"""Set-up of one rank's training: process groups, the model, the DeepSpeed engine, the data and
the resume point, from a resolved run (``train/run.py``); nothing here re-reads a setting."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from aoe_megatron.checkpoint import integrity, optim_state
from aoe_megatron.checkpoint import resume as ckpt
from aoe_megatron.checkpoint.model import load_weights
from aoe_megatron.models.gpt import build_gpt_model, transformer_config
from aoe_megatron.runtime import distributed
from aoe_megatron.runtime.host_memory import gib
from aoe_megatron.train import console, datacheck
from aoe_megatron.train.balance import biased_routers
from aoe_megatron.train.batches import Batches
from aoe_megatron.train.engine import build_engine
from aoe_megatron.train.faults import NonFinitePolicy
from aoe_megatron.train.metrics import attach_stock_router_stats
from aoe_megatron.train.resume_checks import check_config, check_schedule
from aoe_megatron.train.run import Run
from aoe_megatron.train.schedule import run_schedule


@dataclass
class Parts:
    """What the loop steps with; built once by ``set_up``."""

    run: Run
    rank: int
    model: Any
    engine: Any
    scheduler: Any
    batches: Any
    nonfinite: Any
    """faults.NonFinitePolicy (its count of skipped steps continues a resumed run's)."""
    layout: dict
    """World size, EP and ZeRO stage: recorded in every checkpoint."""
    data_fingerprint: Any
    """The data's fingerprint (datacheck): recorded in every checkpoint."""
    stock_stats: list
    """StockRouterStats hooks (MoE baseline); AoE layers keep their own statistics."""
    biased_routers: list
    """The routers with an expert bias (aux-loss-free balancing), updated by the loop
    (``balance``)."""
    start: int = 0
    """Steps already done (a resumed run's)."""


def set_up(run: Run, *, rank: int) -> Parts:
    """Every rank calls this; collective (process groups, engine, resume)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    cfg, world = run.cfg, run.world_size
    distributed.init_megatron(rank=rank, world_size=world,
                              expert_parallel_size=cfg.expert_model_parallel_size, seed=cfg.seed,
                              timeout_minutes=cfg.distributed_timeout_minutes)
    bf16 = cfg.bf16()
    extra = {"bf16": True, "params_dtype": torch.bfloat16} if bf16 else {}
    if cfg.moe_layer_recompute:
        extra.update(recompute_granularity="selective", recompute_modules=["moe"])
    tc = transformer_config(run.model, expert_parallel_size=cfg.expert_model_parallel_size, **extra)
    torch.manual_seed(cfg.seed)
    model = build_gpt_model(run.model, tc)
    if torch.cuda.is_available():
        model = model.cuda()
    engine, _, scheduler = build_engine(
        model, zero_stage=cfg.zero_stage, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
        weight_decay=cfg.weight_decay, micro_batch=cfg.micro_batch_size, grad_accum=run.grad_accum,
        ep_size=cfg.expert_model_parallel_size, num_experts=run.model.num_experts, bf16=bf16,
        grad_accum_dtype=cfg.grad_accum_dtype, clip_grad=cfg.clip_grad,
        lr_schedule=run_schedule(lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.lr_warmup_iters,
                                 total_steps=run.steps),  # a resume may retarget it
    )
    distributed.bound_collective_waits(cfg.distributed_timeout_minutes)  # DeepSpeed's groups too
    MoEAuxLossAutoScaler.set_loss_scale(
        torch.tensor(1.0 / run.grad_accum, device=next(model.parameters()).device))
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    parts = Parts(
        run=run, rank=rank, model=model, engine=engine, scheduler=scheduler,
        batches=Batches(run, dp_rank, dp_size),
        nonfinite=NonFinitePolicy(limit=cfg.skip_nonfinite, ckpt_dir=cfg.save_dir(),
                                  inject=cfg.nonfinite_steps),
        layout={"world_size": world, "expert_parallel_size": cfg.expert_model_parallel_size,
                "zero_stage": cfg.zero_stage},
        data_fingerprint=datacheck.agreed_fingerprint(run.data, run.manifests),
        stock_stats=attach_stock_router_stats(model) if run.model.arch == "moe" else [],
        biased_routers=biased_routers(model),
    )
    parts.start = _resume_or_initialise(parts)
    return parts


def _say(parts: Parts, message: str) -> None:
    if parts.rank == 0:
        console.say(message)


def _resumable(parts: Parts, saved: dict) -> Optional[str]:
    """What this run must share with the checkpoint ``saved`` before it loads (each refusal
    raises): the model and batch, the learning-rate schedule (the checkpoint's is put in force
    with --use-checkpoint-opt_param-scheduler), the data. Returns the note to say once loaded."""
    run, cfg, path = parts.run, parts.run.cfg, saved["path"]
    check_config(saved, run.record(), path)
    schedule, note = check_schedule(saved, run.record(), path)
    datacheck.check_resume(saved.get("data"), parts.data_fingerprint, checkpoint=path,
                           allow=cfg.allow_data_change, announce=parts.rank == 0)
    if schedule is not None:  # --use-checkpoint-opt_param-scheduler
        optim_state.use_schedule(parts.scheduler, schedule)
    return note


def _resume_or_initialise(parts: Parts) -> int:
    """Resume from the newest verified checkpoint in ``--load`` (``--ckpt-dir``), or load
    ``--load-weights``; returns the steps already done."""
    run, cfg = parts.run, parts.run.cfg
    state: Optional[dict] = None
    if cfg.save_dir():
        ckpt.start_writer()  # before any stop signal can reach it
    began = time.perf_counter()
    if cfg.load_dir():
        state = ckpt.resume(
            cfg.load_dir(), mark_verified=cfg.load_dir() == cfg.save_dir(), engine=parts.engine,
            model=parts.model, scheduler=parts.scheduler, layout=parts.layout, seed=cfg.seed,
            log=console.say, before_load=lambda saved: _resumable(parts, saved))
    if state is not None:
        peak = state.get("host_peak_bytes")
        _say(parts, f"resumed from {state['path']} at step {state['step']} in "
                    f"{time.perf_counter() - began:.2f} s"
             + (f" (host memory peak +{gib(peak)} on the busiest rank)" if peak is not None
                else ""))
        if (before := state["layout"]["world_size"]) != run.world_size:
            _say(parts, f"gradient accumulation {cfg.grad_accum(before)} -> {run.grad_accum} "
                        f"micro-batches per rank (global batch {cfg.global_batch_size}, sample "
                        f"order unchanged)")
        parts.nonfinite.restore(state)
        return state["step"]
    if cfg.load_weights:
        # collective; refuses a damaged checkpoint (CheckpointDamaged: exit 3, halted.json)
        # before anything loads
        integrity.require_verified(cfg.load_weights, verify=not cfg.no_verify,
                                   what="--load-weights", log=console.say)
        load_weights(cfg.load_weights, parts.model)
        parts.engine.optimizer.refresh_fp32_params()  # the optimizer's master weights follow
        _say(parts, f"initialised the model from {cfg.load_weights}")
    return 0
