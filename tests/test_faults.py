"""Non-finite steps (stop, or skip at most --skip-nonfinite N) and the data check on resume
(refused when the data differs from the checkpoint's record, unless --allow-data-change)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from aoe_megatron.runtime import launch
from aoe_megatron.train.datacheck import (
    MOCK,
    DataChanged,
    check_resume,
    dataset_fingerprint,
    differences,
    fingerprint,
    sample_sha256,
)
from aoe_megatron.train.faults import NonFiniteError, NonFinitePolicy, TrainingHalted, parse_steps

ROOT = Path(__file__).resolve().parents[1]
NAN, INF = float("nan"), float("inf")
SETTINGS = ["--preset", "tiny", "--expert-model-parallel-size", "2", "--global-batch-size", "4",
            "--micro-batch-size", "1", "--lr-warmup-iters", "3", "--lr", "3e-3", "--zero-stage", "2",
            "--log-interval", "1"]


def _launch(args, *, summary=None) -> launch.Finished:
    """Two CPU ranks through torchrun; bounded in time."""
    return launch.run([*SETTINGS, *args], nproc=2, cwd=ROOT, timeout=240, summary=summary)


def _records(run_dir, kind) -> dict:
    """metrics.jsonl lines of ``kind`` by step (the last one of a step wins); strict JSON."""
    def refuse(name):
        raise ValueError(f"metrics.jsonl holds {name}")

    out = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line, parse_constant=refuse)
        if record["kind"] == kind:
            out[record["step"]] = record
    return out


def _state(ckpt_dir, step) -> dict:
    return json.loads((Path(ckpt_dir) / f"step_{step:08d}" / "state.json").read_text())


# --- the policy --------------------------------------------------------------------------------
def test_parse_steps_and_bad_values_are_refused():
    assert parse_steps("3,5") == (3, 5)
    assert parse_steps(" 5, 3,3 ") == (3, 5)
    assert parse_steps(None) == () and parse_steps("") == ()
    assert parse_steps(4) == (4,)  # a preset's YAML may give a number
    for bad in ("3,x", "0", "-1", "3;5", "1.5", "3,,5"):
        with pytest.raises(ValueError, match="--inject-nonfinite"):
            parse_steps(bad)
    with pytest.raises(ValueError, match="--skip-nonfinite must be >= 0"):
        NonFinitePolicy(limit=-1)


@pytest.mark.parametrize("flags,phrase", [
    (["--skip-nonfinite", "-1"], "--skip-nonfinite must be >= 0, got -1"),
    (["--inject-nonfinite", "3,x"], "--inject-nonfinite '3,x': expected step numbers"),
    (["--inject-nonfinite", "0"], "expected step numbers from 1"),
    (["--inject-nonfinite", "9"], "--inject-nonfinite step 9 is beyond the run's 5 steps"),
])
def test_bad_flags_fail_before_any_process_group(flags, phrase, capsys):
    from aoe_megatron.train.loop import main

    assert main(["--preset", "tiny", "--mock-data", "--train-iters", "5", *flags]) == 2
    assert phrase in capsys.readouterr().err


def test_finite_steps_pass_and_non_finite_ones_stop_by_default():
    policy = NonFinitePolicy(limit=0)
    assert policy.check(1, loss=2.5, grad_norm=0.7, applied=True) is None
    assert policy.check(2, loss=2.5, grad_norm=None, applied=True) is None  # no norm: not judged
    for loss, norm in ((NAN, INF), (INF, 0.5), (2.5, NAN), (2.5, torch.tensor(INF))):
        verdict = policy.check(7, loss=loss, grad_norm=norm, applied=False)
        assert verdict.stopped and verdict.skipped == 0
        assert verdict.message.startswith("step 7: non-finite loss ")
        assert "the run stops (--skip-nonfinite 0)" in verdict.message
        assert "No checkpoint is written without --save (or --ckpt-dir)." in verdict.message
        with pytest.raises(NonFiniteError, match="step 7: non-finite") as err:
            verdict.raise_if_stopped()
        assert isinstance(err.value, TrainingHalted)
    assert policy.state() == {"nonfinite_skipped_steps": []}


def test_at_most_n_steps_are_skipped_and_the_count_survives_a_resume(tmp_path):
    policy = NonFinitePolicy(limit=2)
    first = policy.check(3, loss=NAN, grad_norm=INF, applied=False)
    assert not first.stopped and first.skipped == 1
    assert first.message == ("step 3: non-finite loss nan / grad norm inf; update skipped "
                             "(1 of at most 2, --skip-nonfinite 2)")
    first.raise_if_stopped()  # a skip does not raise
    assert policy.state() == {"nonfinite_skipped_steps": [3]}

    resumed = NonFinitePolicy(limit=2, ckpt_dir=tmp_path)
    resumed.restore(json.loads(json.dumps(policy.state())))  # through state.json
    assert "(2 of at most 2" in resumed.check(5, loss=NAN, grad_norm=INF, applied=False).message
    (tmp_path / "step_00000006").mkdir()
    (tmp_path / "step_00000006" / "state.json").write_text("{}")
    (tmp_path / "latest").write_text("step_00000006\n")
    third = resumed.check(8, loss=NAN, grad_norm=INF, applied=False)
    assert third.stopped and third.skipped == 2
    assert "(step(s) 3, 5 were skipped already, the most --skip-nonfinite 2 allows)" in third.message
    assert f"the last good checkpoint is {tmp_path / 'step_00000006'}" in third.message

    old = NonFinitePolicy(limit=1)
    old.restore({"step": 4})  # a checkpoint from before the count was recorded
    assert not old.check(5, loss=NAN, grad_norm=INF, applied=False).stopped


def test_an_applied_non_finite_update_always_stops(tmp_path):
    policy = NonFinitePolicy(limit=5, ckpt_dir=tmp_path)
    verdict = policy.check(4, loss=NAN, grad_norm=INF, applied=True)
    assert verdict.stopped and verdict.skipped == 0
    assert "the weights may be damaged" in verdict.message
    assert f"No checkpoint was saved in {tmp_path} yet." in verdict.message


def test_injection_makes_rank_0s_loss_nan_at_the_given_steps():
    policy = NonFinitePolicy(limit=0, inject=parse_steps("3,5"))
    loss = torch.tensor(2.0, requires_grad=True)
    assert torch.isnan(policy.inject(3, loss, rank=0)) and torch.isnan(policy.inject(5, loss, 0))
    assert policy.inject(3, loss, rank=1) is loss and policy.inject(4, loss, rank=0) is loss
    policy.inject(3, loss * 3, rank=0).backward()
    assert torch.isnan(loss.grad)  # and so the gradients


def test_the_reporter_logs_a_skip_as_strict_json(tmp_path, capsys):
    from aoe_megatron.train.metrics import Reporter

    policy = NonFinitePolicy(limit=1)
    reporter = Reporter(tmp_path, total_steps=10, tokens_per_step=8, enabled=True)
    reporter.nonfinite(policy.check(3, loss=NAN, grad_norm=INF, applied=False))
    reporter.nonfinite(policy.check(4, loss=INF, grad_norm=None, applied=False))
    reporter.close()
    out = capsys.readouterr().out
    assert "step 3: non-finite loss nan / grad norm inf; update skipped (1 of at most 1" in out
    assert "step 4" not in out  # a stop is the run's error message, printed once by main
    records = _records(tmp_path, "nonfinite")
    assert records[3] == {"kind": "nonfinite", "step": 3, "action": "skipped", "loss": "nan",
                          "grad_norm": "inf", "skipped": 1, "limit": 1}
    assert records[4]["action"] == "stopped" and records[4]["grad_norm"] is None


# --- the data fingerprint -------------------------------------------------------------------------
def _dataset(prefix="data/a_text_document", **changes) -> dict:
    base = {"role": "blend", "prefix": prefix, "weight": 1.0, "tokenizer_sha256": "aa" * 32,
            "documents": 10, "tokens": 5000, "sources_sha256": "bb" * 32, "bin_bytes": 10000,
            "idx_bytes": 300, "bin_sample_sha256": "cc" * 32, "idx_sample_sha256": "dd" * 32}
    return {**base, **changes}


def test_every_difference_is_listed_with_both_values():
    recorded = {"split": "90,10,0", "datasets": [_dataset(), _dataset("data/b_text_document")]}
    assert differences(recorded, json.loads(json.dumps(recorded))) == []
    moved = {"split": "90,10,0", "datasets": [_dataset("/elsewhere/a_text_document"),
                                              _dataset("data/b_text_document")]}
    assert differences(recorded, moved) == []  # the same data at another path
    changed = {"split": "80,20,0", "datasets": [
        _dataset(tokens=6000, tokenizer_sha256="ee" * 32),
        _dataset("data/b_text_document", weight=2.0, bin_sample_sha256="ff" * 32)]}
    assert differences(recorded, changed) == [
        "split: 90,10,0 (checkpoint) vs 80,20,0 (now)",
        f"blend data/a_text_document: tokenizer_sha256: {'aa' * 32} (checkpoint) vs {'ee' * 32} (now)",
        "blend data/a_text_document: tokens: 5000 (checkpoint) vs 6000 (now)",
        "blend data/b_text_document: weight: 1.0 (checkpoint) vs 2.0 (now)",
        f"blend data/b_text_document: bin_sample_sha256: {'cc' * 32} (checkpoint) vs "
        f"{'ff' * 32} (now)",
    ]
    fewer = {"split": "90,10,0", "datasets": [_dataset()]}
    assert differences(recorded, fewer) == [
        "datasets: blend data/a_text_document, blend data/b_text_document (checkpoint) vs "
        "blend data/a_text_document (now)"]
    assert differences(MOCK, MOCK) == [] and fingerprint(None) == MOCK
    assert differences(MOCK, fewer) == [
        "datasets: mock data (random tokens) (checkpoint) vs blend data/a_text_document (now)"]
    assert differences(fewer, MOCK) == [
        "datasets: blend data/a_text_document (checkpoint) vs mock data (random tokens) (now)"]


def test_resume_is_refused_on_changed_data_unless_allowed(capsys):
    recorded = {"split": None, "datasets": [_dataset()]}
    current = {"split": None, "datasets": [_dataset(tokens=4321)]}
    assert check_resume(recorded, recorded, checkpoint="ck/step_2", allow=False, announce=True) == []
    with pytest.raises(DataChanged) as err:
        check_resume(recorded, current, checkpoint="ck/step_2", allow=False, announce=True)
    assert isinstance(err.value, TrainingHalted)
    message = str(err.value)
    assert message.startswith("the data differs from what ck/step_2 was trained on:\n")
    assert "blend data/a_text_document: tokens: 5000 (checkpoint) vs 4321 (now)" in message
    assert "--allow-data-change" in message
    lines = check_resume(recorded, current, checkpoint="ck/step_2", allow=True, announce=True)
    assert lines == ["blend data/a_text_document: tokens: 5000 (checkpoint) vs 4321 (now)"]
    out = capsys.readouterr().out
    assert "WARNING: --allow-data-change" in out and "5000 (checkpoint) vs 4321 (now)" in out
    assert check_resume(None, current, checkpoint="ck/old", allow=False, announce=True) == []
    assert "ck/old records no data fingerprint" in capsys.readouterr().out


def test_sampled_hash_reads_three_samples_of_a_large_file(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 100)
    small = sample_sha256(str(path))  # whole file: at most three samples long
    path.write_bytes(b"x" * 50 + b"y" + b"x" * 49)
    assert sample_sha256(str(path)) != small
    data = bytearray(b"x" * 1000)
    path.write_bytes(data)
    base = sample_sha256(str(path), sample=10)
    for where, seen in ((0, True), (500, True), (995, True), (300, False)):
        changed = bytearray(data)
        changed[where] = ord("y")
        path.write_bytes(changed)
        assert (sample_sha256(str(path), sample=10) != base) == seen, where
    path.write_bytes(data + b"x")  # the size is hashed too
    assert sample_sha256(str(path), sample=10) != base


def _preprocess(out_prefix, lines) -> str:
    from aoe_megatron.data.assets import CORPUS
    from aoe_megatron.data.preprocess import PreprocessConfig, preprocess

    src = Path(f"{out_prefix}.jsonl")
    src.write_text("\n".join(CORPUS.read_text(encoding="utf-8").splitlines()[lines]) + "\n")
    return next(iter(preprocess(PreprocessConfig(
        inputs=(str(src),), output_prefix=str(out_prefix), append_eod=True, workers=0,
        overwrite=True, log_interval=1e9))))


def test_dataset_fingerprint_comes_from_the_manifest_and_the_files(tmp_path):
    prefix = _preprocess(tmp_path / "corpus", slice(0, 3))
    manifest = json.loads(Path(f"{prefix}.manifest.json").read_text())
    fp = dataset_fingerprint(prefix)
    assert (fp["tokens"], fp["documents"]) == (manifest["tokens"], manifest["documents"])
    assert fp["tokenizer_sha256"] == manifest["tokenizer"]["sha256"]
    assert fp["bin_bytes"] == os.path.getsize(f"{prefix}.bin")
    assert fp["idx_sample_sha256"] == sample_sha256(f"{prefix}.idx")
    assert dataset_fingerprint(prefix) == fp
    _preprocess(tmp_path / "corpus", slice(3, 6))  # other text into the same prefix
    changed = dataset_fingerprint(prefix)
    for key in ("tokens", "sources_sha256", "bin_bytes", "bin_sample_sha256", "idx_sample_sha256"):
        assert changed[key] != fp[key], key
    assert changed["tokenizer_sha256"] == fp["tokenizer_sha256"]


def test_data_rebuilt_into_the_same_prefix_gets_fresh_dataset_indices(tmp_path):
    from aoe_megatron.data.blend import build_datasets

    prefix = _preprocess(tmp_path / "corpus", slice(0, 20))
    blend = {"blend": [{"prefix": prefix, "weight": 1}], "split": "90,10,0"}
    build_datasets(blend, seq_length=64, seed=1, num_samples=(200, 10, 0))
    _preprocess(tmp_path / "corpus", slice(20, 30))  # 10 documents instead of 20
    train, _, _ = build_datasets(blend, seq_length=64, seed=1, num_samples=(200, 10, 0))
    gpt = train.datasets[0] if hasattr(train, "datasets") else train
    assert int(gpt.document_index.max()) < len(gpt.dataset), "indices of the old documents"


# --- end to end: two ranks through torchrun -------------------------------------------------------
@pytest.mark.slow
@pytest.mark.distributed
def test_non_finite_steps_are_skipped_within_the_limit_then_stop_the_run(tmp_path):
    """NaN losses injected at steps 3 and 5 of 6; checkpoints every 2 steps, validation every
    step. With --skip-nonfinite 1 the run skips 3, saves 4 and stops at 5, keeping step 4; the
    same command with 2 resumes from 4 (one skip already counted), skips 5 and ends. A skipped
    step leaves the weights alone: its validation loss equals the step before's."""
    ck, run = tmp_path / "ck", tmp_path / "run"
    args = ["--mock-data", "--train-iters", "6", "--save-interval", "2", "--eval-interval", "1",
            "--eval-iters", "1", "--inject-nonfinite", "3,5", "--ckpt-dir", str(ck),
            "--run-dir", str(run)]

    first = _launch([*args, "--skip-nonfinite", "1"])
    out = first.output
    assert first.returncode != 0, out
    assert "step 3: non-finite loss nan / grad norm inf; update skipped (1 of at most 1" in out
    assert ("error: step 5: non-finite loss nan / grad norm inf; the run stops (step(s) 3 were "
            "skipped already, the most --skip-nonfinite 1 allows)") in out
    assert f"the last good checkpoint is {ck / 'step_00000004'}" in out
    assert (ck / "latest").read_text().strip() == "step_00000004"
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_00000002", "step_00000004"]
    assert _state(ck, 4)["nonfinite_skipped_steps"] == [3] and _state(ck, 4)["data"] == MOCK
    assert json.loads((run / "halted.json").read_text())["reason"] == "NonFiniteError"
    assert _records(run, "nonfinite")[5]["action"] == "stopped"
    assert sorted(_records(run, "train")) == [1, 2, 4]

    summary = tmp_path / "summary.json"
    second = _launch([*args, "--skip-nonfinite", "2"], summary=summary)
    out = second.output
    assert second.returncode == 0, out
    assert f"resumed from {ck / 'step_00000004'}" in out
    assert "step 5: non-finite loss nan / grad norm inf; update skipped (2 of at most 2" in out
    assert second.summary()["nonfinite_skipped"] == [3, 5]
    assert _state(ck, 6)["nonfinite_skipped_steps"] == [3, 5]
    assert not (run / "halted.json").exists() and (run / "finished.json").exists()
    skips = _records(run, "nonfinite")
    assert [(s, r["action"], r["skipped"]) for s, r in sorted(skips.items())] == [
        (3, "skipped", 1), (5, "skipped", 2)]
    train, valid = _records(run, "train"), _records(run, "valid")
    assert sorted(train) == [1, 2, 4, 6] and sorted(valid) == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(r["loss"]) for r in train.values())
    for skipped in (3, 5):  # the weights after a skipped step are those before it
        torch.testing.assert_close(valid[skipped]["loss"], valid[skipped - 1]["loss"],
                                   rtol=0, atol=0, msg=f"step {skipped} changed the weights")
    assert valid[4]["loss"] != valid[3]["loss"]  # a step that is not skipped trains


@pytest.mark.slow
@pytest.mark.distributed
def test_resume_on_changed_data_is_refused_unless_allowed(tmp_path):
    """Train 2 steps on a tiny corpus, preprocess other text into the same prefix, resume."""
    prefix = _preprocess(tmp_path / "corpus", slice(0, 20))
    data = tmp_path / "data.yaml"
    data.write_text(f"blend:\n  - {{prefix: {prefix}, weight: 1}}\nsplit: '90,10,0'\n")
    ck, run = tmp_path / "ck", tmp_path / "run"
    args = ["--data-path", str(data), "--eval-interval", "0", "--eval-iters", "1", "--ckpt-dir",
            str(ck), "--run-dir", str(run)]
    first = _launch([*args, "--train-iters", "2"])
    assert first.returncode == 0, first.output
    recorded = _state(ck, 2)["data"]
    assert recorded == json.loads(json.dumps(fingerprint(str(data))))

    _preprocess(tmp_path / "corpus", slice(20, 45))
    now = fingerprint(str(data))["datasets"][0]
    # longer than the checkpoint's run, on its own lr schedule (tests/test_resume_schedule.py)
    refused = _launch([*args, "--train-iters", "3", "--override-opt_param-scheduler"])
    out = refused.output
    assert refused.returncode != 0, out
    assert f"error: the data differs from what {ck / 'step_00000002'} was trained on:" in out
    then = recorded["datasets"][0]
    for key in ("tokens", "documents", "sources_sha256", "bin_sample_sha256"):
        assert then[key] != now[key], key
        assert f"blend {prefix}: {key}: {then[key]} (checkpoint) vs {now[key]} (now)" in out, key
    assert "--allow-data-change" in out
    assert (ck / "latest").read_text().strip() == "step_00000002"
    assert json.loads((run / "halted.json").read_text())["reason"] == "DataChanged"

    allowed = _launch([*args, "--train-iters", "3", "--allow-data-change",
                       "--override-opt_param-scheduler"])
    out = allowed.output
    assert allowed.returncode == 0, out
    assert "WARNING: --allow-data-change: resuming from" in out
    assert f"tokens: {then['tokens']} (checkpoint) vs {now['tokens']} (now)" in out
    assert (ck / "latest").read_text().strip() == "step_00000003"
    assert _state(ck, 3)["data"]["datasets"][0] == json.loads(json.dumps(now))  # recorded anew
