"""The training console (issue #36, item 2): timestamped, rank-tagged logging lines whose figures
are the run's (tokens consumed = steps x global batch x sequence length, the step's own gradient
norm, ms per step against tokens/s), the resolved arguments printed and in TensorBoard equal to
config.json, upstream's repeated lines at most once, the CPU threads of a single process, and
the study runner reading the lines after their prefix. Weights & Biases: test_wandb_run.py."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import TINY_RUN, run_distributed

STEP = re.compile(
    r"step +(?P<step>\d+)/(?P<total>\d+)  loss (?P<loss>[\d.]+)  lr (?P<lr>\S+)  grad norm "
    r"(?P<norm>[\d.]+)  (?P<ms>[\d,.]+) ms/step  (?P<tps>[\d,]+) tokens/s  (?P<tokens>[\d,]+) "
    r"tokens  skipped (?P<skipped>\d+)  memory (?P<gib>[\d.]+) GiB \(host RSS\)  ETA")
PREFIX = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\]\[rank (\d+)\] (.*)$")


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def _seq_length() -> int:
    from aoe_megatron.models.gpt import load_preset

    return load_preset("tiny").seq_length


def _metrics(run_dir: Path, kind: str = "train") -> dict:
    lines = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r for r in lines if r["kind"] == kind}


def _scalars(run_dir: Path, tag: str) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


def _flatten(record: dict, prefix: str = "") -> dict:
    """config.json's leaves by dotted name, as the console prints them (lists as JSON)."""
    out = {}
    for key, value in record.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = (json.dumps(value) if isinstance(value, (list, dict))
                                     else str(value))
    return out


# --- the figures of a logging step, against an independent computation -------------------------

def _run_three_steps(rank, world, run_dir):
    """Three logged steps of the tiny preset (world 1); step 1's gradient norm computed apart by
    plain autograd on the initial weights, against what the console, metrics.jsonl and
    TensorBoard say."""
    from aoe_megatron.moe import loss_tracker
    from aoe_megatron.train import console
    from aoe_megatron.train.batches import lm_loss
    from aoe_megatron.train.loop import EndOfStep
    from aoe_megatron.train.metrics import Reporter
    from aoe_megatron.train.run import parse_run
    from aoe_megatron.train.setup import set_up
    from aoe_megatron.train.step import train_step

    run = parse_run(["--preset", "tiny", "--mock-data", "--train-iters", "3", "--log-interval", "1",
                     "--eval-interval", "0", "--lr-warmup-iters", "1", "--run-dir", str(run_dir)],
                    world_size=1)
    parts = set_up(run, rank=0)
    gas, params = run.grad_accum, [p for p in parts.model.parameters() if p.requires_grad]
    grads = [torch.zeros_like(p) for p in params]
    for micro in range(gas):  # step 1's gradient: the mean over its micro-batches
        loss = lm_loss(parts.model, parts.batches.train_batch(0, micro, gas))
        for g, d in zip(grads, torch.autograd.grad(loss / gas, params, allow_unused=True)):
            if d is not None:
                g += d
    loss_tracker.clear()
    reference = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()

    said = []
    catcher = logging.Handler()
    catcher.emit = lambda record: said.append(record.getMessage())
    console.LOGGER.addHandler(catcher)
    tokens_per_step = run.cfg.global_batch_size * run.model.seq_length
    reporter = Reporter(run_dir, total_steps=run.steps, tokens_per_step=tokens_per_step,
                        enabled=True)
    end, norms = EndOfStep(parts, reporter, run_dir), []
    for step in range(run.steps):
        result = train_step(parts, step, stop_flag=SimpleNamespace(raised=False), log=True)
        norms.append(float(parts.engine.get_global_grad_norm()))
        end(result)
    reporter.close()

    lines = {int(m["step"]): m for m in map(STEP.search, said) if m}
    assert sorted(lines) == [1, 2, 3], said
    assert len(set(norms)) == 3, norms  # a stale norm would repeat
    logged = _metrics(run_dir)
    tb_norms = _scalars(run_dir, "train/grad_norm")
    torch.testing.assert_close(logged[1]["grad_norm"], reference, rtol=1e-4, atol=0,
                               msg="step 1's logged gradient norm against autograd's")
    for step, line in lines.items():
        assert float(line["norm"]) == pytest.approx(norms[step - 1], abs=5e-5), (step, said)
        assert logged[step]["grad_norm"] == norms[step - 1]
        assert tb_norms[step] == pytest.approx(norms[step - 1], rel=1e-6)
        assert (_number(line["tokens"]) == logged[step]["tokens"]
                == step * run.cfg.global_batch_size * run.model.seq_length)
        assert int(line["skipped"]) == logged[step]["skipped"] == 0


@pytest.mark.slow
@pytest.mark.distributed
def test_the_logged_gradient_norm_is_the_steps_and_tokens_count_every_step(tmp_path):
    run_distributed(_run_three_steps, 1, tmp_path / "run", expert_parallel_size=1)


# --- the tiny reference run: its console, metrics.jsonl and TensorBoard ------------------------

@pytest.mark.slow
@pytest.mark.distributed
def test_the_reference_runs_console_figures_are_its_records(tiny_reference_run):
    from aoe_megatron.models.params import count_parameters
    from aoe_megatron.models.gpt import load_preset

    run_dir, output = tiny_reference_run["run"], tiny_reference_run["output"]
    seq, batch = _seq_length(), TINY_RUN["global_batch_size"]
    ours = [m for m in map(PREFIX.match, output.splitlines()) if m]
    assert ours, output[-3000:]
    stamps = [m[1] for m in ours if m[2] == "0"]
    assert stamps == sorted(stamps)  # rank 0's lines, in order
    steps = {}
    for stamp, rank, text in (m.groups() for m in ours):
        if (found := STEP.match(text)) is not None:
            assert rank == "0", text  # rank 0 alone reports steps
            steps[int(found["step"])] = found
    assert sorted(steps) == list(range(1, 9)), output[-3000:]

    logged, tb_tokens = _metrics(run_dir), _scalars(run_dir, "train/tokens")
    tb_norms = _scalars(run_dir, "train/grad_norm")
    for step, line in steps.items():
        tokens = step * batch * seq
        assert _number(line["tokens"]) == logged[step]["tokens"] == tb_tokens[step] == tokens
        assert float(line["norm"]) == pytest.approx(logged[step]["grad_norm"], abs=5e-5)
        assert tb_norms[step] == pytest.approx(logged[step]["grad_norm"], rel=1e-6)
        assert _number(line["ms"]) == pytest.approx(logged[step]["ms_per_step"], abs=0.051)
        # tokens/s is one step's tokens over its milliseconds
        assert logged[step]["tokens_per_s"] == pytest.approx(
            batch * seq / (logged[step]["ms_per_step"] / 1e3), rel=1e-9)
        assert _number(line["tps"]) == pytest.approx(logged[step]["tokens_per_s"], abs=0.51)
        assert float(line["gib"]) == pytest.approx(logged[step]["memory_bytes"] / 2**30,
                                                   abs=0.0051)
        assert 2**26 < logged[step]["memory_bytes"] < 2**36
        assert int(line["skipped"]) == logged[step]["skipped"] == 0

    # the start: the resolved arguments (console and TensorBoard) are config.json
    config = json.loads((run_dir / "config.json").read_text())
    printed = {}
    for _, _, text in (m.groups() for m in ours):
        if (arg := re.match(r"  (\S+) \.+ (.*)$", text)) is not None:
            printed[arg[1]] = arg[2]
    assert printed == _flatten(config)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    acc.Reload()
    (event,) = acc.Tensors("config/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert text.startswith("```json\n") and text.endswith("\n```")
    assert json.loads(text[len("```json\n"):-len("\n```")]) == config

    counts = count_parameters(load_preset("tiny"))
    said = "\n".join(m[3] for m in ours)
    assert f"total ({counts.total:,}), " in said and f"per token ({counts.active:,})" in said
    layout = re.search(r"global batch (\d+) = micro-batch (\d+) x (\d+) accumulation step\(s\) x "
                       r"data-parallel (\d+), (\d+) tokens per sequence \(([\d,]+) tokens per step",
                       said)
    g, micro, accum, dp, s, per_step = layout.groups()
    assert (int(g), int(micro), int(dp), int(s)) == (batch, TINY_RUN["micro_batch_size"], 2, seq)
    assert int(micro) * int(accum) * int(dp) == batch and _number(per_step) == batch * seq
    assert "FutureWarning" not in output, output[-3000:]  # torch's, raised inside DeepSpeed


# --- the pieces, in this process -------------------------------------------------------------

def test_a_console_line_is_a_message_after_a_fixed_prefix(monkeypatch):
    from aoe_megatron.train import console

    monkeypatch.setenv("RANK", "3")
    handler = console._handler()
    record = logging.LogRecord("aoe_megatron.train", logging.INFO, __file__, 1,
                               "step       2/4  loss 1.0", None, None)
    handler.filter(record)
    line = handler.format(record)
    assert PREFIX.match(line)[2] == "3"
    assert console.message(line) == "step       2/4  loss 1.0"
    assert console.message("step 2") == "step 2"  # a line without the prefix stays as it is


def test_upstream_dataset_lines_pass_once_and_only_the_named_future_warnings_are_dropped():
    from aoe_megatron.runtime.upstream_noise import quiet_repeated_upstream_lines

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet_repeated_upstream_lines()
        seen = []
        catcher = logging.Handler()
        catcher.emit = lambda record: seen.append(record.getMessage())
        logger = logging.getLogger("megatron.core.datasets.blended_dataset")
        logger.addHandler(catcher)
        try:
            for _ in range(3):
                logger.warning("Building a BlendedDataset for a single MegatronDataset")
                logger.warning("Cannot save the BlendedDataset indexes because path_to_cache is "
                               "None")
            logger.warning("another line")
            logger.warning("another line")
        finally:
            logger.removeHandler(catcher)
        warnings.warn("Please use DTensor instead and we are deprecating ShardedTensor.",
                      FutureWarning)
        warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
                      "`torch.distributed.all_gather_single` instead.", FutureWarning)
        warnings.warn("`load_state_dict` is deprecated and will be removed in future versions. "
                      "Please use `load` instead.", FutureWarning)
        warnings.warn("Please use DTensor instead and we are deprecating ShardedTensor.",
                      UserWarning)  # another category: kept
        warnings.warn("some other future", FutureWarning)
        warnings.warn("torch.distributed is disabled, unavailable or uninitialized, assuming the "
                      "intent is to load in a single process.", UserWarning)  # torch 2.11's
    assert seen == ["Building a BlendedDataset for a single MegatronDataset",
                    "Cannot save the BlendedDataset indexes because path_to_cache is None",
                    "another line", "another line"]
    assert [(w.category, str(w.message)) for w in caught] == [
        (UserWarning, "Please use DTensor instead and we are deprecating ShardedTensor."),
        (FutureWarning, "some other future")]


def test_a_training_process_waits_passively_unless_told_or_too_late():
    """OMP_WAIT_POLICY=PASSIVE before torch loads (GNU OpenMP reads it then), never over the
    user's value, and not once torch has loaded; each case in a fresh interpreter."""
    code = ("import os, sys\n"
            "from aoe_megatron.train.threads import prefer_passive_wait, said\n"
            "early = 'torch' in sys.modules\n"
            "if sys.argv[1] == 'late':\n"
            "    import torch\n"
            "line = prefer_passive_wait()\n"
            "print(early, os.environ.get('OMP_WAIT_POLICY'), line == said(), bool(line))\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}

    def run(case, **extra):
        return subprocess.run([sys.executable, "-c", code, case], env={**env, **extra},
                              capture_output=True, text=True, check=True).stdout.split()

    assert run("early") == ["False", "PASSIVE", "True", "True"]
    assert run("early", OMP_WAIT_POLICY="ACTIVE") == ["False", "ACTIVE", "True", "False"]
    assert run("late") == ["False", "None", "True", "False"]


def test_the_study_runner_echoes_the_progress_lines_after_their_prefix(tmp_path):
    from aoe_megatron.study.runner import _run_logged

    lines = ["[2026-12-06 21:15:01][rank 0] step       2/4  loss 10.3869",
             "[2026-12-06 21:15:02][rank 0] resumed from ck/step_00000002 at step 2 in 0.46 s",
             "[2026-12-06 21:15:03][rank 0] saved ck/step_00000004 (1.2 s)", "evaluated ck: 1.0"]
    echoed = []
    _run_logged([sys.executable, "-c", f"print({chr(10).join(lines)!r})"], tmp_path / "log",
                env=dict(os.environ), what="aoe/seed1", echo=echoed.append)
    assert echoed == [f"    aoe/seed1: {line}" for line in (lines[0], lines[1], lines[3])]
    assert (tmp_path / "log").read_text().endswith("\n".join(lines) + "\n")
