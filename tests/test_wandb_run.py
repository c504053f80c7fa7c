"""Weights & Biases (issue #36, item 2), offline: a single-process run with --wandb-project,
resumed, holds the run's figures and arguments; the same run on the CPU threads chosen for it and
without upstream's repeated lines; --wandb-project without wandb refused, naming the extra."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aoe_megatron.runtime import launch

ROOT = Path(__file__).resolve().parents[1]


def _metrics(run_dir: Path, kind: str = "train") -> dict:
    lines = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r for r in lines if r["kind"] == kind}


def _key(item) -> str:
    """A W&B record item's name (a name with a slash is stored as a one-part ``nested_key``)."""
    return item.key or "/".join(item.nested_key)


def _wandb_records(wandb_dir: Path) -> list:
    """The records of each offline run under ``wandb_dir`` ({"run", "config", "history"}), from its
    .wandb file: LevelDB's log format (32 KiB blocks; chunks of CRC, length, type) after a 7-byte
    header, each record a ``wandb_internal_pb2.Record``."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    runs = []
    for path in sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb")):
        data, pos, chunks, records = path.read_bytes(), 7, b"", []
        while pos + 7 <= len(data):
            left = 32768 - pos % 32768
            if left < 7:
                pos += left
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            if kind == 0:
                pos += left
                continue
            chunks += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # FULL or LAST
                records.append(pb.Record.FromString(chunks))
                chunks = b""
        run = {"history": {}}
        for r in records:
            if r.WhichOneof("record_type") == "run":
                run["run"] = (r.run.project, r.run.display_name)
                run["config"] = {_key(i): json.loads(i.value_json)
                                 for i in r.run.config.update if _key(i) != "_wandb"}
            elif r.WhichOneof("record_type") == "history":
                run["history"][r.history.step.num] = {_key(i): json.loads(i.value_json)
                                                      for i in r.history.item}
        runs.append(run)
    return runs


@pytest.mark.slow
def test_wandb_offline_threads_and_upstream_lines_of_a_resumed_run(corpus, tmp_path):
    pytest.importorskip("wandb")
    env = {k: v for k, v in os.environ.items()
           if k not in (*launch.LAUNCHER_VARS, "OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    env.update(WANDB_MODE="offline", WANDB_DIR=str(tmp_path / "wandb"), WANDB_SILENT="true")
    (tmp_path / "wandb").mkdir()
    args = ["--preset", "tiny", "--data-path", corpus["data"], "--log-interval", "1",
            "--eval-interval", "2", "--eval-iters", "1", "--lr-warmup-iters", "1",
            "--ckpt-dir", tmp_path / "ck", "--run-dir", tmp_path / "run",
            "--wandb-project", "aoe-console-test"]
    outputs = []
    for steps, name, extra in ((2, "first", []),
                               (3, "resumed", ["--override-opt_param-scheduler"])):
        proc = subprocess.run(launch.command([*args, "--train-iters", steps, "--wandb-exp-name",
                                              name, *extra]),
                              env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        outputs.append(proc.stdout + proc.stderr)

    # W&B: each launch a run, its config config.json, its history metrics.jsonl's figures
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    logged, valid = _metrics(tmp_path / "run"), _metrics(tmp_path / "run", "valid")
    first, resumed = _wandb_records(tmp_path / "wandb")
    assert first["run"] == ("aoe-console-test", "first")
    assert resumed["run"] == ("aoe-console-test", "resumed")
    assert resumed["config"] == config  # the last launch wrote config.json
    assert first["config"]["train"]["train_iters"] == 2
    assert sorted(first["history"]) == [1, 2] and sorted(resumed["history"]) == [3]
    from aoe_megatron.models.gpt import load_preset

    tokens_per_step = 8 * load_preset("tiny").seq_length  # tiny's global batch
    for step, row in {**first["history"], **resumed["history"]}.items():
        for tag, key in (("loss", "loss"), ("lr", "lr"), ("grad_norm", "grad_norm"),
                         ("tokens", "tokens"), ("skipped_steps", "skipped"),
                         ("ms_per_step", "ms_per_step"), ("tokens_per_s", "tokens_per_s")):
            assert row[f"train/{tag}"] == logged[step][key], (step, key)
        assert row["train/tokens"] == step * tokens_per_step
    assert first["history"][2]["valid/loss"] == valid[2]["loss"]

    # OpenMP: torch's default threads, waiting passively (set before torch loaded), said and recorded
    default = int(subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env,
        capture_output=True, text=True, check=True).stdout)
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["threads"] == {"torch": default, "OMP_NUM_THREADS": None,
                                 "OMP_WAIT_POLICY": "PASSIVE"}
    for output in outputs:
        assert "OMP_WAIT_POLICY is not set: OpenMP's threads wait passively" in output

    # upstream: the one-dataset blend said once a launch, no FutureWarning (the resume's included)
    for output in outputs:
        assert output.count("Building a BlendedDataset for a single MegatronDataset") == 1, output
        assert "FutureWarning" not in output, output[-4000:]
    assert "resumed from" in outputs[1]


def test_wandb_project_without_wandb_is_refused_naming_the_extra(monkeypatch, capsys):
    from aoe_megatron.train.loop import main

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    argv = ["--preset", "tiny", "--mock-data", "--train-iters", "1"]
    assert main([*argv, "--wandb-project", "p"]) == 2
    assert "pip install 'aoe-megatron[wandb]'" in capsys.readouterr().err
    assert main([*argv, "--wandb-exp-name", "n"]) == 2
    assert "give the project too" in capsys.readouterr().err
