"""The pretraining entry point: argument checks, exact resume after SIGTERM, crash-safe saves,
TensorBoard and the run record."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import torch

from aoe_megatron.runtime import launch
from tests.helpers import run_distributed, tiny_run_args

ROOT = Path(__file__).resolve().parents[1]


#: The tiny run's first losses, recorded on 2026-12-04 at 3ed2fe6 (this project's CI-class VM,
#: torch 2.13.0 CPU), before issue #22 reorganises the launch: a change of the math moves them
#: by far more than 1e-6 (relative), another CPU's kernels by less. Re-pin only for a change of
#: the math made on purpose, and say why. World 2 / EP 2: tests.helpers.TINY_RUN, --mock-data,
#: 8 steps.
PINNED_W2_EP2 = {1: 10.386086463928223, 2: 10.382135391235352, 3: 10.386457443237305,
                 4: 10.389907836914062, 5: 10.365836143493652, 6: 10.383447647094727,
                 7: 10.381346702575684, 8: 10.37588882446289}
#: World 1: ``python -m aoe_megatron.train --preset tiny --train-iters 2 --mock-data``.
PINNED_W1 = {1: 10.372169494628906, 2: 10.389126777648926}


def _assert_pinned(losses: dict, pinned: dict) -> None:
    got = {step: losses[step] for step in pinned}
    assert got == pytest.approx(pinned, rel=1e-6), (got, pinned)


@pytest.mark.legs
@pytest.mark.slow
@pytest.mark.distributed
def test_resume_after_sigterm_equals_uninterrupted_run(tiny_reference_run, tmp_path):
    reference = tiny_reference_run["losses"]
    _assert_pinned(reference, PINNED_W2_EP2)

    args = [*tiny_reference_run["args"], "--ckpt-dir", tmp_path / "ck", "--run-dir", tmp_path / "run"]
    with open(tmp_path / "first.log", "w") as log:
        proc = launch.start(args, nproc=2, cwd=ROOT, stdout=log)
        deadline = time.monotonic() + 300
        while "step       3/8" not in (tmp_path / "first.log").read_text():
            assert proc.poll() is None, (tmp_path / "first.log").read_text()
            assert time.monotonic() < deadline, "the run never reached step 3"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=300)
    first = (tmp_path / "first.log").read_text()
    assert "stopped by a signal" in first, first
    stopped_at = int((tmp_path / "ck" / "latest").read_text().strip().split("_")[1])
    assert 3 <= stopped_at < 8

    resumed = launch.run(args, nproc=2, cwd=ROOT, timeout=600, summary=tmp_path / "resumed.json",
                         env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "1"})  # a stop window no save fits
    assert resumed.returncode == 0, resumed.output
    assert f"resumed from {tmp_path / 'ck'}" in resumed.output
    # The stop window (issue #34): warned at the resume, from the checkpoint's record, and after
    # each save of the resumed run (every 2 steps and the last); each save has its metrics line.
    assert f"WARNING: the last recorded save (step_{stopped_at:08d}) took" in resumed.output
    later = [s for s in range(stopped_at + 1, 9) if s % 2 == 0 or s == 8]
    assert resumed.output.count("1 s stop window") == 1 + len(later), resumed.output[-3000:]
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    saves = [json.loads(line) for line in metrics if '"kind": "save"' in line]
    assert [r["step"] for r in saves][-len(later) - 1:] == [stopped_at, *later]
    assert saves[-1]["stop_window_s"] == 1.0 and saves[-1]["bytes"] > 0
    summary = resumed.summary()
    assert summary["start"] == stopped_at
    after = summary["losses"]
    assert sorted(after) == list(range(stopped_at + 1, 9))
    for step, loss in after.items():
        assert loss == pytest.approx(reference[step], rel=1e-6, abs=1e-6), step

    # The weights saved at EP=2 load at EP=1 (still two processes): the validation loss is the same.
    ep1_args = tiny_run_args(expert_model_parallel_size=1, train_iters=1, eval_interval=1, lr=1e-12,
                             min_lr=1e-12, load_weights=tiny_reference_run["ckpt"] / "step_00000008",
                             run_dir=tmp_path / "run_ep1")
    at_ep1 = launch.run(ep1_args, nproc=2, cwd=ROOT, timeout=600, summary=tmp_path / "ep1.json")
    assert at_ep1.returncode == 0, at_ep1.output
    assert "initialised the model from" in at_ep1.output
    ep1_valid = at_ep1.summary()["valid_losses"][1]
    assert ep1_valid == pytest.approx(tiny_reference_run["summary"]["valid_losses"][8], rel=1e-5)

    # TensorBoard and the run record.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tiny_reference_run["run"]))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "valid/loss",
                "train/aux_loss", "ent_load/layer_01", "ent_conf/layer_02",
                "expert_load/layer_01/expert_3", "expert_norm/layer_02/expert_0"):
        assert tag in tags, (tag, sorted(tags))
    record = json.loads((tiny_reference_run["run"] / "run.json").read_text())
    assert record["world_size"] == 2 and "megatron_core" in record["versions"]
    assert record["selection_stats"] == "every training micro-batch since the previous logging step"
    config = json.loads((tiny_reference_run["run"] / "config.json").read_text())
    assert config["model"]["arch"] == "aoe" and config["train"]["expert_model_parallel_size"] == 2


def _crash_during_save(rank, world_size, ckpt_dir):
    from aoe_megatron.models.gpt import build_gpt_model, load_preset, transformer_config
    from aoe_megatron.checkpoint import integrity
    from aoe_megatron.checkpoint.layout import latest_checkpoint
    from aoe_megatron.runtime import hashing
    from aoe_megatron.checkpoint import resume as ckpt
    from aoe_megatron.checkpoint.save import save_checkpoint
    from aoe_megatron.train.engine import build_engine

    cfg = load_preset("tiny", vocab_size=512)
    torch.manual_seed(0)
    model = build_gpt_model(cfg, transformer_config(cfg, expert_parallel_size=2))
    engine, _, sched = build_engine(model, zero_stage=1, lr=1e-3, micro_batch=1, grad_accum=1,
                                    ep_size=2, num_experts=cfg.num_experts)
    layout = {"world_size": 2, "expert_parallel_size": 2, "zero_stage": 1}
    read, real = [], integrity.sha256_file  # the manifest re-reads no data file (issue #34)
    integrity.sha256_file = lambda p: read.append(str(p)) or real(p)
    try:
        good = save_checkpoint(ckpt_dir, step=2, engine=engine, model=model, scheduler=sched,
                               consumed_samples=4, layout=layout, config={})
    finally:
        integrity.sha256_file = real
    assert read and not [p for p in read if p.endswith(".distcp")], read
    files = integrity.read_checkpoint_manifest(good)["files"]
    assert not [p for p in good.rglob("*") if hashing.is_record(p)]
    for name, entry in files.items():
        assert entry["sha256"] == real(good / name), name
    save = json.loads((good / "state.json").read_text())["save"]
    assert save["seconds"] > 0 and save["bytes"] == sum(
        e["size"] for n, e in files.items() if n != "state.json")
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    original = ckpt.optim_state.sharded_optimizer_state

    def failing_optimizer_state(model, engine, **kwargs):
        raise OSError("disk full (injected)")

    # The crash comes after the model shards of step 4 are written, before anything is renamed.
    ckpt.optim_state.sharded_optimizer_state = failing_optimizer_state
    try:
        with pytest.raises(OSError, match="injected"):
            save_checkpoint(ckpt_dir, step=4, engine=engine, model=model, scheduler=sched,
                            consumed_samples=8, layout=layout, config={})
    finally:
        ckpt.optim_state.sharded_optimizer_state = original
    torch.distributed.barrier()
    assert latest_checkpoint(ckpt_dir) == good
    assert not list(Path(ckpt_dir).glob("*.partial-*"))
    ckpt.load_checkpoint(good, engine=engine, model=model, scheduler=sched, layout=layout)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p, saved[n], rtol=0, atol=0, msg=n)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_crash_while_saving_keeps_the_previous_checkpoint(tmp_path):
    run_distributed(_crash_during_save, 2, tmp_path / "ck")


@pytest.mark.parametrize(
    "args,env,phrase",
    [
        (["--preset", "tiny", "--train-iters", "2", "--mock-data", "--expert-model-parallel-size", "3"], {"WORLD_SIZE": "3"},
         "not divisible by expert parallel size"),
        (["--preset", "tiny", "--train-iters", "2", "--mock-data", "--expert-model-parallel-size", "2", "--zero-stage", "3"],
         {"WORLD_SIZE": "2"}, "ZeRO-3 with expert parallelism"),
        (["--preset", "nonexistent", "--train-iters", "2"], {}, "no preset"),
        (["--preset", "tiny", "--train-iters", "2", "--keep-last", "-1", "--mock-data"], {},
         "--keep-last must be >= 0"),
        (["--preset", "tiny"], {}, "exactly one of --train-iters and --train-tokens"),
        (["--preset", "tiny", "--train-iters", "2", "--mock-data", "--tensor-model-parallel-size", "2"], {},
         "tensor and pipeline parallelism are not supported yet"),
        (["--preset", "tiny", "--train-iters", "2", "--mock-data", "--set", "num_layer=3"], {},
         "unknown model settings ['num_layer']"),
        (["--preset", "tiny", "--train-iters", "2", "--mock-data", "--set", "aoe.d_low=64"], {},
         "must be smaller than d_model"),
        (["--preset", "tiny", "--train-iters", "2"], {}, "no --data-path: give a data config"),
        (["--preset", "tiny", "--train-iters", "2", "--data-path", "run/data-shakespeare.yaml",
          "--mock-data"], {}, "--data-path and --mock-data exclude each other"),
    ],
)
def test_bad_arguments_fail_before_any_process_group(args, env, phrase, monkeypatch, capsys):
    import torch.distributed as dist

    from aoe_megatron.train.loop import main

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    was_initialized = dist.is_initialized()
    assert main(args) == 2
    assert phrase in capsys.readouterr().err
    assert dist.is_initialized() == was_initialized


def test_model_overrides_reach_the_model():
    from aoe_megatron.train.run import parse_run

    run = parse_run(["--preset", "aoe_732m", "--train-iters", "1", "--set", "num_layers=3",
                     "--set", "aoe.d_low=128", "--arch", "moe", "--mock-data"], world_size=1)
    cfg, model = run.cfg, run.model
    assert (model.num_layers, model.aoe.d_low, model.arch) == (3, 128, "moe")
    assert model.hidden_size == 768 and cfg.global_batch_size == 2048  # the preset's recipe
    assert cfg.lr == 2e-4 and cfg.lr_warmup_iters == 4800 and cfg.min_lr == 1.28e-5
    assert cfg.train_iters == 1 and cfg.train_tokens is None  # the CLI length replaces the preset's


def test_unknown_preset_key_and_foreign_tokenizer_are_refused(tmp_path, capsys):
    from aoe_megatron.data.preprocess import PreprocessConfig, preprocess
    from aoe_megatron.data.train_tokenizer import train_tokenizer
    from aoe_megatron.train.loop import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("base: tiny\ntrain:\n  learning_rate: 1.0\n")
    assert main(["--preset", str(bad), "--train-iters", "2"]) == 2
    assert "unknown train settings ['learning_rate']" in capsys.readouterr().err
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps({"text": f"document number {i} " * 20}) + "\n" for i in range(40)))
    preprocess(PreprocessConfig(inputs=(str(src),), output_prefix=str(tmp_path / "d"),
                                append_eod=True, workers=0, log_interval=1e9))
    other = train_tokenizer([str(src)], str(tmp_path / "other"), vocab_size=300)
    data = tmp_path / "data.yaml"
    data.write_text(f"blend:\n  - {{prefix: {tmp_path / 'd_text_document'}, weight: 1}}\n")
    assert main(["--preset", "tiny", "--train-iters", "2", "--data-path", str(data),
                 "--tokenizer-model", str(other)]) == 2
    assert "not the tokenizer given" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["aoe", "moe"])
def test_selection_statistics_for_both_architectures(megatron_world, arch):
    import math

    from aoe_megatron.models.gpt import build_gpt_model, load_preset
    from aoe_megatron.train.metrics import attach_stock_router_stats, selection_stats

    cfg = load_preset("tiny", arch=arch, vocab_size=512)
    torch.manual_seed(0)
    model = build_gpt_model(cfg)
    stock = attach_stock_router_stats(model) if arch == "moe" else []
    tokens = torch.randint(0, 512, (2, 17))
    pos = torch.arange(16).unsqueeze(0).expand(2, -1)
    model(tokens[:, :-1], pos, None, labels=tokens[:, 1:]).mean().backward()
    stats = selection_stats(model, stock)
    assert sorted(stats) == [1, 2]
    for s in stats.values():
        assert sum(s["load"]) == pytest.approx(1.0, abs=1e-6)
        assert 0 < s["ent_load"] <= math.log(cfg.num_experts) + 1e-9
        assert 0 < s["ent_conf"] <= math.log(cfg.num_experts) + 1e-6
        assert len(s["mean_norm"]) == cfg.num_experts


@pytest.mark.legs
@pytest.mark.slow
@pytest.mark.distributed
def test_bare_single_process_launch_trains_on_mock_data_and_says_so(tmp_path):
    """``python -m aoe_megatron.train`` without a launcher runs as world size 1; --mock-data is
    announced and recorded; megatron-core's per-layer "Unknown MLP type" line and the TE/apex
    import warnings are replaced by one line."""
    run_dir = tmp_path / "run"
    out = launch.run(["--preset", "tiny", "--train-iters", "2", "--mock-data",
                      "--run-dir", run_dir], nproc=1, cwd=ROOT, timeout=600)
    log = out.output
    assert out.returncode == 0, log[-3000:]
    assert "step       2/2  loss" in log
    assert "WARNING: --mock-data: training on random tokens" in log
    assert "mock" in json.loads((run_dir / "run.json").read_text())["data"]
    losses = {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").open())
              if r["kind"] == "train"}
    _assert_pinned(losses, PINNED_W1)
    assert "Unknown MLP type" not in log
    assert "Transformer Engine" not in log and "Apex is not installed" not in log
    assert log.count("[rank 0] no TransformerEngine, no NVIDIA apex: using PyTorch kernels") == 1
