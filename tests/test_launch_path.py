"""One launch path (issue #22): a launch reads each of its inputs once, and a training step makes
one collective of the loop's own (the selection statistics join it on logging steps only)."""

from __future__ import annotations

import builtins
import io
import os
import tempfile
import traceback
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from aoe_megatron.runtime import launch
from tests.helpers import run_distributed

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = str(ROOT / "aoe_megatron") + os.sep
TINY = ["--preset", "tiny", "--global-batch-size", "4", "--micro-batch-size", "1",
        "--lr-warmup-iters", "1", "--eval-interval", "0", "--zero-stage", "1"]


# --- what a launch reads ----------------------------------------------------------------------

def _count_reads(rank, world, argv, watched):
    """Run the entry point in this (already grouped) process, counting opens of ``watched``."""
    from aoe_megatron.train.loop import main

    watched = {str(Path(p).resolve()): 0 for p in watched}
    real_open = builtins.open

    def counting_open(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)):
            path = str(Path(file).resolve())
            if path in watched:
                watched[path] += 1
        return real_open(file, *args, **kwargs)

    builtins.open = io.open = counting_open
    try:
        code = main(argv)
    finally:
        builtins.open = io.open = real_open
    assert code == 0
    assert watched == {path: 1 for path in watched}, watched


@pytest.mark.slow
@pytest.mark.distributed
def test_a_launch_reads_the_preset_the_data_config_and_each_manifest_once(corpus, tmp_path):
    from aoe_megatron.data.config import DataConfig
    from aoe_megatron.models.gpt import PRESET_DIR

    prefixes = DataConfig.load(corpus["data"]).prefixes
    watched = [PRESET_DIR / "tiny.yaml", corpus["data"], *(f"{p}.manifest.json" for p in prefixes)]
    argv = [*TINY, "--data-path", str(corpus["data"]), "--train-iters", "1",
            "--ckpt-dir", str(tmp_path / "ckpt"), "--run-dir", str(tmp_path / "run")]
    run_distributed(_count_reads, 1, argv, watched, expert_parallel_size=1)


# --- the collectives of a step ----------------------------------------------------------------

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "barrier", "all_to_all", "all_to_all_single",
               "all_gather_object", "broadcast_object_list", "gather", "scatter", "send", "recv")


def _caller(stack) -> str:
    """Whose collective this is: 'loop' when the innermost frame outside torch is the training
    loop's code (aoe_megatron/train, or runtime helpers called from it), else 'other' (DeepSpeed,
    megatron-core, the MoE layer's all-to-all)."""
    frames = [f.filename for f in stack if f"{os.sep}torch{os.sep}" not in f.filename
              and f.filename != __file__]
    for filename in reversed(frames):
        if not filename.startswith(PACKAGE):
            return "other"
        if os.sep + "runtime" + os.sep in filename:
            continue  # a helper: judged by its caller
        return "loop" if os.sep + "train" + os.sep in filename else "other"
    return "other"


def _count_step_collectives(rank, world):
    import torch.distributed as dist

    from aoe_megatron.train.run import parse_run
    from aoe_megatron.train.setup import set_up
    from aoe_megatron.train.step import train_step
    from aoe_megatron.train.loop import EndOfStep
    from aoe_megatron.train.metrics import Reporter

    # with aux-loss-free balancing: the bias update's counts ride in the same all-reduce
    run = parse_run([*TINY, "--mock-data", "--train-iters", "4", "--log-interval", "2",
                     "--expert-model-parallel-size", str(world), "--set", "expert_bias=true"],
                    world_size=world)
    parts = set_up(run, rank=rank)
    reporter = Reporter(None, total_steps=run.steps, tokens_per_step=1, enabled=False)
    end = EndOfStep(parts, reporter, Path(tempfile.mkdtemp()))  # finished.json goes there
    calls: list = []
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counted(name):
        def call(*args, **kwargs):
            calls.append((name, _caller(traceback.extract_stack()[:-1])))
            return originals[name](*args, **kwargs)
        return call

    for name in COLLECTIVES:
        setattr(dist, name, counted(name))
    no_stop = SimpleNamespace(raised=False)
    per_step = []
    try:
        for step in range(run.steps):
            calls.clear()
            log = (step + 1) % 2 == 0
            end(train_step(parts, step, stop_flag=no_stop, log=log))
            per_step.append((log, Counter(name for name, who in calls if who == "loop"),
                             sum(who == "other" for _, who in calls)))
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    for log, ours, _ in per_step:
        # a non-logging step: one all-reduce (loss, non-finite verdict, stop flag); a logging
        # step adds the selection statistics' all-reduce
        assert ours == Counter(all_reduce=2 if log else 1), per_step
    assert any(other for _, _, other in per_step), "the counter saw none of DeepSpeed's collectives"
    biases = torch.stack([r.expert_bias for r in parts.biased_routers])  # [layers, experts]
    assert biases.abs().sum() > 0  # the loop moved them ...
    highest, lowest = biases.clone(), biases.clone()
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    torch.testing.assert_close(highest, lowest, rtol=0, atol=0)  # ... the same on every rank


@pytest.mark.slow
@pytest.mark.distributed
def test_a_non_logging_step_makes_one_collective_of_the_loops_own():
    run_distributed(_count_step_collectives, 2)


# --- the launcher -----------------------------------------------------------------------------

def test_the_launcher_builds_one_command_for_one_or_many_processes():
    one = launch.command(["--preset", "tiny"])
    assert one[1:] == ["-m", "aoe_megatron.train", "--preset", "tiny"]
    two = launch.command(["--preset", "tiny"], nproc=2)
    assert two[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    assert two[5] == "2" and "--master_port" not in two  # torchrun binds its own port
    with pytest.raises(ValueError):
        launch.command([], nproc=0)


def test_a_child_run_does_not_inherit_the_launchers_rank(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("MASTER_PORT", "1234")
    env = launch.child_env({"X": 1}, threads=1)
    assert "RANK" not in env and "MASTER_PORT" not in env
    assert env["X"] == "1" and env["OMP_NUM_THREADS"] == "1"
