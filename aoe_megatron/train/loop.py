"""The pretraining loop: ``python -m aoe_megatron.train --preset tiny --train-steps 100 ...``.

Launch with torchrun / srun / the deepspeed launcher (one process per GPU, or per CPU slot).
Data parallel x expert parallel; restarting the same command resumes from ``--ckpt-dir``'s latest
checkpoint; SIGTERM or SIGUSR1 (Slurm's warnings before preemption or the time limit) saves a
checkpoint and exits.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import sys
import time
from pathlib import Path

import torch

from aoe_megatron.runtime.distributed import reduce_across_ranks
from aoe_megatron.train.config import (
    TrainConfig,
    adopt_slurm_env,
    parse_train_args,
    resolved,
    world_size_from_env,
)
from aoe_megatron.train.errors import TrainingHalted
from aoe_megatron.train.faults import clear_halt_record, write_halt_record
from aoe_megatron.train.host_memory import gib

EXIT_OK = 0
"""Finished, or stopped by a signal after saving: the run directory tells them apart
(``finished.json``, which the Slurm template checks before it requeues). A stop is not an error:
torchrun would report a worker's non-zero exit as a crash, and restart it where allowed."""
EXIT_HALTED = 3


class _StopFlag:
    """Set by SIGTERM / SIGUSR1; the ranks agree on it at step boundaries."""

    def __init__(self):
        self.raised = False
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.raised = True

    def agreed(self) -> bool:
        return bool(reduce_across_ranks(torch.tensor(float(self.raised)), op="max").item())


def _record_run(cfg: TrainConfig, run_dir: Path, world_size: int) -> None:
    import deepspeed
    import megatron.core

    import aoe_megatron

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(resolved(cfg), indent=2, default=str) + "\n")
    record = {
        "command": [sys.executable, *sys.argv],
        "world_size": world_size,
        "versions": {"aoe_megatron": aoe_megatron.__version__, "torch": torch.__version__,
                     "megatron_core": megatron.core.__version__, "deepspeed": deepspeed.__version__,
                     "python": platform.python_version()},
        "host": platform.node(),
    }
    if cfg.mock_data:
        record["data"] = "mock: random tokens (--mock-data), not a corpus"
    if cfg.data is not None:
        from aoe_megatron.data.blend import DataConfig, check_manifests

        manifest = check_manifests(DataConfig.load(cfg.data).prefixes)
        record["data_tokenizer_sha256"] = manifest["tokenizer"]["sha256"]
        record["data_policy"] = manifest["policy"]
    (run_dir / "run.json").write_text(json.dumps(record, indent=2) + "\n")


def train(cfg: TrainConfig) -> dict:
    """Run (or resume) training; every rank calls this. Returns a summary on rank 0."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_utils import (
        MoEAuxLossAutoScaler,
        clear_aux_losses_tracker,
    )

    from aoe_megatron.runtime.distributed import bound_collective_waits, init_megatron
    from aoe_megatron.models.gpt import build_gpt_model, transformer_config
    from aoe_megatron.train import checkpoint as ckpt
    from aoe_megatron.train import datacheck
    from aoe_megatron.train.batches import Batches, lm_loss
    from aoe_megatron.train.engine import build_engine
    from aoe_megatron.train.faults import NonFinitePolicy, parse_steps
    from aoe_megatron.train.metrics import Reporter, attach_stock_router_stats, selection_stats
    from aoe_megatron.train.schedule import lr_lambda

    world = world_size_from_env()
    cfg.validate(world)  # before any process group starts
    rank = int(os.environ.get("RANK", "0"))
    if cfg.mock_data and rank == 0:
        print("WARNING: --mock-data: training on random tokens, not a corpus (smoke and debugging "
              "runs only)", flush=True)
    stop = _StopFlag()
    init_megatron(rank=rank, world_size=world, expert_parallel_size=cfg.expert_parallel_size,
                  seed=cfg.seed, timeout_minutes=cfg.distributed_timeout_minutes)
    model_cfg = cfg.model
    on_gpu = torch.cuda.is_available()
    bf16 = cfg.bf16()
    extra = {"bf16": True, "params_dtype": torch.bfloat16} if bf16 else {}
    if cfg.recompute:
        extra.update(recompute_granularity="selective", recompute_modules=["moe"])
    tc = transformer_config(model_cfg, expert_parallel_size=cfg.expert_parallel_size, **extra)
    torch.manual_seed(cfg.seed)
    model = build_gpt_model(model_cfg, tc)
    if on_gpu:
        model = model.cuda()
    steps = cfg.steps()
    gas = cfg.grad_accum(world)
    engine, _, scheduler = build_engine(
        model, zero_stage=cfg.zero_stage, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
        weight_decay=cfg.weight_decay, micro_batch=cfg.micro_batch_size, grad_accum=gas,
        ep_size=cfg.expert_parallel_size, num_experts=model_cfg.num_experts, bf16=bf16,
        grad_accum_dtype=cfg.grad_accum_dtype,
        clip_grad=cfg.clip_grad,
        lr_schedule=lr_lambda(peak=cfg.lr, final=cfg.min_lr,
                              warmup_steps=min(cfg.warmup_steps, steps - 1), total_steps=steps),
    )
    bound_collective_waits(cfg.distributed_timeout_minutes)  # DeepSpeed's groups too
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / gas, device=next(model.parameters()).device))
    layout = {"world_size": world, "expert_parallel_size": cfg.expert_parallel_size,
              "zero_stage": cfg.zero_stage}
    data = datacheck.agreed_fingerprint(cfg.data)  # recorded in every checkpoint
    nonfinite = NonFinitePolicy(limit=cfg.skip_nonfinite, ckpt_dir=cfg.ckpt_dir,
                                inject=parse_steps(cfg.inject_nonfinite))
    start = 0
    state = None
    if cfg.ckpt_dir:
        ckpt.start_writer()  # before any stop signal can reach it
        state = ckpt.resume(cfg.ckpt_dir, engine=engine, model=model, scheduler=scheduler,
                            layout=layout, config=resolved(cfg), seed=cfg.seed,
                            log=lambda msg: print(msg, flush=True),
                            before_load=lambda saved: datacheck.check_resume(
                                saved.get("data"), data, checkpoint=saved["path"],
                                allow=cfg.allow_data_change, announce=rank == 0))
    if state is not None:
        start = state["step"]
        if rank == 0:
            peak = state.get("host_peak_bytes")
            print(f"resumed from {state['path']} at step {start}"
                  + (f" (host memory peak +{gib(peak)} on the busiest rank)" if peak is not None
                     else ""), flush=True)
            if (before := state["layout"]["world_size"]) != world:
                print(f"gradient accumulation {cfg.grad_accum(before)} -> {gas} micro-batches per "
                      f"rank (global batch {cfg.global_batch_size}, sample order unchanged)",
                      flush=True)
        nonfinite.restore(state)
    elif cfg.load_weights:
        ckpt.load_model_weights(cfg.load_weights, model)
        engine.optimizer.refresh_fp32_params()  # the optimizer's master weights follow the model
        if rank == 0:
            print(f"initialised the model from {cfg.load_weights}", flush=True)
    run_dir = Path(cfg.run_dir)
    if rank == 0:
        _record_run(cfg, run_dir, world)
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    batches = Batches(cfg, model_cfg, dp_rank, dp_size)
    reporter = Reporter(run_dir, total_steps=steps,
                        tokens_per_step=cfg.global_batch_size * model_cfg.seq_length,
                        enabled=rank == 0)
    stock_stats = attach_stock_router_stats(model) if model_cfg.arch == "moe" else []
    losses, valid_losses, stopped = {}, {}, False

    def evaluate(step: int) -> float:
        model.eval()
        with torch.no_grad():
            total = sum(lm_loss(engine, batches.valid_batch(i)).detach().float()
                        for i in range(cfg.eval_iters))
        model.train()
        value = reduce_across_ranks(total, op="mean").item() / cfg.eval_iters
        reporter.scalar("valid/loss", value, step)
        if rank == 0:
            print(f"step {step:>7}/{steps}  validation loss {value:.4f}", flush=True)
        valid_losses[step] = value
        return value

    def save(step: int) -> None:
        if cfg.ckpt_dir:
            stats, began = {}, time.perf_counter()
            path = ckpt.save_checkpoint(cfg.ckpt_dir, step=step, engine=engine, model=model,
                                        scheduler=scheduler,
                                        consumed_samples=step * cfg.global_batch_size,
                                        layout=layout, config=resolved(cfg),
                                        keep_last=cfg.keep_last,
                                        extra={"data": data, **nonfinite.state()},
                                        stats=stats)
            if rank == 0:
                peak = stats.get("host_peak_bytes")
                print(f"saved {path} ({time.perf_counter() - began:.1f} s"
                      + (f"; host memory peak +{gib(peak)} on the busiest rank" if peak is not None
                         else "") + ")", flush=True)

    try:
        for step in range(start, steps):
            lr = scheduler.get_last_lr()[0]
            step_loss = 0.0  # on the model's device: no host sync per micro-batch
            for micro in range(gas):
                loss = lm_loss(engine, batches.train_batch(step, micro, gas))
                loss = nonfinite.inject(step + 1, loss, rank)  # --inject-nonfinite (tests)
                engine.backward(loss)
                engine.step()
                step_loss = step_loss + loss.detach().float() / gas
            aux = None
            try:
                from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

                tracker = get_moe_layer_wise_logging_tracker()
                if "load_balancing_loss" in tracker:
                    aux = float(tracker["load_balancing_loss"]["values"].sum()) / gas
            finally:
                clear_aux_losses_tracker()
            losses[step + 1] = reduce_across_ranks(step_loss, op="mean").item()
            log_now = (step + 1) % cfg.log_interval == 0 or step + 1 == steps
            grad_norm = engine.get_global_grad_norm()
            verdict = nonfinite.check(step + 1, loss=losses[step + 1], grad_norm=grad_norm,
                                      applied=engine.was_step_applied())
            if verdict is not None:  # skipped (weights unchanged) or stopped (nothing saved)
                reporter.nonfinite(verdict)
                verdict.raise_if_stopped()
            else:
                reporter.step(step + 1, loss=losses[step + 1], lr=lr, grad_norm=grad_norm,
                              stats=selection_stats(model, stock_stats),
                              aux_loss=aux, console=log_now)
            done = step + 1 == steps
            if cfg.eval_interval and ((step + 1) % cfg.eval_interval == 0 or done):
                evaluate(step + 1)
            if stop.agreed():
                save(step + 1)
                stopped = True
                if rank == 0:
                    print(f"stopped by a signal after step {step + 1}; restart the same command "
                          f"to resume", flush=True)
                break
            if done or (cfg.save_interval and (step + 1) % cfg.save_interval == 0):
                save(step + 1)
            if done and rank == 0:
                (run_dir / "finished.json").write_text(json.dumps(
                    {"steps": steps, "final_loss": losses[steps],
                     "final_valid_loss": valid_losses.get(steps)}) + "\n")
    finally:
        reporter.close()
    if rank == 0:
        print(f"run directory: {run_dir.resolve()} (config.json, run.json, TensorBoard: "
              f"tensorboard --logdir {run_dir})", flush=True)
        if cfg.ckpt_dir:
            print(f"checkpoints: {Path(cfg.ckpt_dir).resolve()} (restart the same command to resume)",
                  flush=True)
    return {"losses": losses, "valid_losses": valid_losses, "stopped": stopped, "start": start,
            "nonfinite_skipped": nonfinite.skipped_steps}


def main(argv=None) -> int:
    from aoe_megatron.runtime.compat import fallback_note, quiet_cpu_fallback_warnings

    quiet_cpu_fallback_warnings()
    adopt_slurm_env()  # a bare srun: RANK / WORLD_SIZE / LOCAL_RANK from Slurm's variables
    try:
        cfg = parse_train_args(argv)
        cfg.validate(world_size_from_env())
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from aoe_megatron.runtime.distributed import shutdown
    from aoe_megatron.train.config import adopt_single_process_env

    adopt_single_process_env()
    if (note := fallback_note()) is not None:  # once per process, for the warnings it replaces
        print(f"[rank {os.environ.get('RANK', '0')}] {note}", flush=True)
    rank0 = int(os.environ.get("RANK", "0")) == 0
    try:
        if rank0:
            clear_halt_record(cfg.run_dir)
        summary = train(cfg)
        if rank0 and os.environ.get("AOE_SUMMARY"):
            Path(os.environ["AOE_SUMMARY"]).write_text(json.dumps(summary) + "\n")
    except TrainingHalted as err:  # non-finite step, changed data, no resumable checkpoint
        if rank0:
            print(f"error: {err}", file=sys.stderr, flush=True)
            write_halt_record(cfg.run_dir, err)
        return EXIT_HALTED
    finally:
        shutdown()
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
