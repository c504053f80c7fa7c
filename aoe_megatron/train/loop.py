"""The pretraining loop: ``aoe-train --preset tiny --train-iters 100 ...`` (one process), or
``torchrun --nproc-per-node N -m aoe_megatron.train ...`` / srun / the deepspeed launcher (one
process per GPU, or per CPU slot). Data parallel x expert parallel; with ``--load`` (or
``--ckpt-dir``) restarting the same command resumes from the newest checkpoint that verifies; SIGTERM or SIGUSR1 (Slurm's warnings before preemption or the time limit) saves a
checkpoint and exits.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from aoe_megatron.checkpoint.errors import CheckpointError
from aoe_megatron.checkpoint.save import save_checkpoint
from aoe_megatron.data.index_cache import DataCacheError
from aoe_megatron.runtime import signals
from aoe_megatron.runtime.distributed import reduce_across_ranks, shutdown
from aoe_megatron.runtime.launch import SUMMARY_VAR
from aoe_megatron.train import console, threads
from aoe_megatron.train.batches import lm_loss
from aoe_megatron.train.config import TrainConfig
from aoe_megatron.train.launcher_env import adopt_single_process_env, adopt_slurm_env
from aoe_megatron.train.data_index import build_index_only
from aoe_megatron.train.errors import TrainingHalted
from aoe_megatron.train.faults import clear_halt_record, write_halt_record
from aoe_megatron.train.lock import FolderHeld, FolderLock
from aoe_megatron.train.metrics import Reporter, reset_selection_stats, selection_stats
from aoe_megatron.train.run import Run, parse_run, resolve
from aoe_megatron.train.run_dir import open_run_dir, resolve_run_dir
from aoe_megatron.train.run_record import record_run, start_lines
from aoe_megatron.train.setup import Parts, set_up
from aoe_megatron.train.step import StepResult, train_step
from aoe_megatron.train.stop_window import StopWindow
from aoe_megatron.train.wandb_sink import WandbSink

EXIT_OK = 0
"""Finished, or stopped by a signal after saving: the run directory tells them apart
(``finished.json``, which the Slurm template checks before it requeues). A stop is not an error:
torchrun would report a worker's non-zero exit as a crash, and restart it where allowed."""
EXIT_HALTED = 3
EXIT_FOLDER_HELD = 4
"""Another launch holds the --save folder (``train/lock.py``); nothing was written."""


def _with_run_dir(run: Run) -> Run:
    """``run`` with its run directory resolved (``train/run_dir.py``; rank 0 only)."""
    return replace(run, cfg=replace(run.cfg, run_dir=resolve_run_dir(run.cfg)))


class EndOfStep:
    """After each step, on every rank: judge a non-finite step, report, validate, save, and
    say whether the run stops here."""

    def __init__(self, parts: Parts, reporter, run_dir: Path | None):
        self.parts, self.reporter, self.run_dir = parts, reporter, run_dir
        self.run, self.cfg = parts.run, parts.run.cfg
        self.losses: dict = {}
        self.valid_losses: dict = {}
        self.stopped = False
        resumed = parts.start and parts.rank == 0  # rank 0 reads the checkpoints' save records
        self.window = StopWindow(start_step=parts.start, say=self._say, reporter=reporter,
                                 resumed_from=self.cfg.load_dir() if resumed else None)

    def __call__(self, result: StepResult) -> bool:
        """True: the run ends after this step (finished, or stopped by a signal)."""
        parts, cfg, step = self.parts, self.cfg, result.step
        self.losses[step] = result.loss
        verdict = parts.nonfinite.check(step, loss=result.loss, grad_norm=result.grad_norm,
                                        applied=result.applied,
                                        nonfinite_ranks=result.nonfinite_ranks)
        if verdict is not None:  # skipped (weights unchanged) or stopped (nothing saved)
            self.reporter.nonfinite(verdict)
            verdict.raise_if_stopped()
        else:
            stats = selection_stats(parts.model, parts.stock_stats) if result.log else {}
            self.reporter.step(step, loss=result.loss, lr=result.lr, grad_norm=result.grad_norm,
                               stats=stats, aux_loss=result.aux_loss, console=result.log,
                               bias_tokens=result.bias_tokens,
                               skipped=len(parts.nonfinite.skipped_steps))
        done = step == self.run.steps
        if cfg.eval_interval and (step % cfg.eval_interval == 0 or done):
            self.evaluate(step)
        if result.stop:
            self.save(step)
            self.stopped = True
            self._say(f"stopped by a signal after step {step}; restart the same command to "
                      f"resume")
            return True
        if done or (cfg.save_interval and step % cfg.save_interval == 0):
            self.save(step)
        if done and parts.rank == 0:
            (self.run_dir / "finished.json").write_text(json.dumps(
                {"steps": step, "final_loss": self.losses[step],
                 "final_valid_loss": self.valid_losses.get(step)}) + "\n")
        return done

    def _say(self, message: str) -> None:
        if self.parts.rank == 0:
            console.say(message)

    def evaluate(self, step: int) -> float:
        parts, cfg = self.parts, self.cfg
        parts.model.eval()
        with torch.no_grad():
            total = sum(lm_loss(parts.engine, parts.batches.valid_batch(i)).detach().float()
                        for i in range(cfg.eval_iters))
        parts.model.train()
        reset_selection_stats(parts.model, parts.stock_stats)  # the next log covers training only
        value = reduce_across_ranks(total, op="mean").item() / cfg.eval_iters
        self.reporter.scalar("valid/loss", value, step)
        self._say(f"step {step:>7}/{self.run.steps}  validation loss {value:.4f}")
        self.valid_losses[step] = value
        return value

    def save(self, step: int) -> None:
        parts, cfg = self.parts, self.cfg
        if not cfg.save_dir():
            return
        stats, began = {}, time.perf_counter()
        path = save_checkpoint(cfg.save_dir(), step=step, engine=parts.engine,
                               model=parts.model, scheduler=parts.scheduler,
                               consumed_samples=step * cfg.global_batch_size,
                               layout=parts.layout, config=self.run.record(),
                               keep_last=cfg.keep_last,
                               extra={"data": parts.data_fingerprint,
                                      **parts.nonfinite.state(), **self.window.record(step)},
                               stats=stats)
        self.window.saved(step, path, seconds=time.perf_counter() - began, stats=stats)


def train(run) -> dict:
    """Run (or resume) training; every rank calls this with the same resolved run
    (``train.run.Run``; a ``TrainConfig`` is resolved here). Returns a summary on rank 0.
    The stop signals mean what ``runtime/signals.py`` says while it runs."""
    stop = signals.stop_signals()
    if stop.active:  # main() holds them
        return _train(run, stop)
    with stop:
        return _train(run, stop)


def _train(run, stop) -> dict:
    console.set_up()
    if isinstance(run, TrainConfig):
        run = resolve(run)
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        run = _with_run_dir(run)  # config.json and the checkpoints record it
    cfg = run.cfg
    if cfg.mock_data and rank == 0:
        console.say("WARNING: --mock-data: training on random tokens, not a corpus (smoke and "
                    "debugging runs only)")
    parts = set_up(run, rank=rank)  # until the first step, SIGTERM ends the process
    run_dir = None  # rank 0's alone (train/run_dir.py)
    if rank == 0:
        run_dir = Path(cfg.run_dir)
        open_run_dir(run_dir, resumed=parts.start > 0, say=console.say)
        record_run(run, run_dir)
    reporter = Reporter(run_dir, total_steps=run.steps,
                        tokens_per_step=cfg.global_batch_size * run.model.seq_length,
                        enabled=rank == 0, tensorboard_dir=cfg.tensorboard_dir,
                        wandb=WandbSink.open(cfg, record=run.record(), run_dir=run_dir,
                                             enabled=rank == 0))
    reporter.start(run.record(), start_lines(parts) if rank == 0 else [])
    end = EndOfStep(parts, reporter, run_dir)
    stop.training = True  # from here SIGTERM / SIGUSR1 mean: save after this step, then stop
    try:
        for step in range(parts.start, run.steps):
            log = (step + 1) % cfg.log_interval == 0 or step + 1 == run.steps
            if end(train_step(parts, step, stop_flag=stop, log=log)):
                break
    finally:
        reporter.close()
    if rank == 0:
        console.say(f"run directory: {run_dir.resolve()} (config.json, run.json, TensorBoard: "
                    f"tensorboard --logdir {cfg.tensorboard_dir or run_dir})")
        if cfg.save_dir():
            resumes = cfg.load_dir() == cfg.save_dir()
            console.say(f"checkpoints: {Path(cfg.save_dir()).resolve()} ("
                        + ("restart the same command to resume" if resumes else
                           f"resume with --load {cfg.save_dir()}") + ")")
    return {"losses": end.losses, "valid_losses": end.valid_losses, "stopped": end.stopped,
            "start": parts.start, "nonfinite_skipped": parts.nonfinite.skipped_steps}


def main(argv=None) -> int:
    """``aoe-train``: 0 finished or stopped after saving, 2 bad settings, 3 halted, 4 folder
    held, 128 + N ended by signal N (SIGINT at any time; SIGTERM before the first step)."""
    try:
        with signals.stop_signals():
            return _main(argv)
    except signals.Interrupted as err:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"{err}: ended before the run finished; nothing was saved since the last "
                  f"checkpoint", file=sys.stderr, flush=True)
        return err.code


def _main(argv=None) -> int:
    adopt_slurm_env()  # a bare srun: RANK / WORLD_SIZE / LOCAL_RANK from Slurm's variables
    try:
        run = parse_run(argv)  # read and validated once, before any process group starts
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    console.set_up()
    if run.cfg.build_data_index_only:
        try:
            build_index_only(run, say=console.say)
        except DataCacheError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        return EXIT_OK

    if threads.said() and int(os.environ.get("RANK", "0")) == 0:
        console.say(threads.said())
    adopt_single_process_env()
    rank0 = int(os.environ.get("RANK", "0")) == 0
    if rank0:
        run = _with_run_dir(run)  # before the lock's lease and the halt record name it
    held = None
    if rank0 and run.cfg.save_dir():  # one writer per checkpoint folder, before anything is written
        try:
            held = FolderLock(run.cfg.save_dir(), run_dir=run.cfg.run_dir,
                              say=lambda m: print(m, file=sys.stderr, flush=True)).acquire()
        except FolderHeld as err:
            print(f"error: {err}. This launch wrote nothing; wait for that one to end, or save "
                  f"elsewhere.", file=sys.stderr, flush=True)
            return EXIT_FOLDER_HELD
    try:
        if rank0:
            clear_halt_record(run.cfg.run_dir)
        summary = train(run)
        if rank0 and os.environ.get(SUMMARY_VAR):  # for launchers (runtime.launch.run)
            Path(os.environ[SUMMARY_VAR]).write_text(json.dumps(summary) + "\n")
    except DataCacheError as err:  # the same on a restart: a setting or filesystem to fix
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    except (TrainingHalted, CheckpointError) as err:  # non-finite step, changed data, no
        # resumable checkpoint; --load-weights damaged or saved by a later megatron-core
        if rank0:
            print(f"error: {err}", file=sys.stderr, flush=True)
            write_halt_record(run.cfg.run_dir, err)
        return EXIT_HALTED
    finally:
        shutdown()
        if held is not None:
            held.release()
    return EXIT_OK


if __name__ == "__main__":
    from aoe_megatron.runtime.exit import exit_now

    exit_now(main())  # as SystemExit(main()), less a second of interpreter teardown
