"""A Megatron-LM user's first day (issue #32): no silent hang on a small corpus, Megatron-LM's
data flags and corpora accepted, each path mistake named, EOD enforced, and stop signals that end
a process stuck before its first step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from aoe_megatron.data.config import DataConfig
from aoe_megatron.train.loop import main as train_main
from aoe_megatron.train.run import parse_run

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--preset", "tiny", "--train-iters", "2", "--eval-iters", "1"]


def _preprocess(folder: Path, name: str, lines: list, *, eod: bool = True) -> Path:
    from aoe_megatron.cli.preprocess import main as preprocess_main

    src = folder / f"{name}.jsonl"
    src.write_text("".join(lines))
    args = ["--input", str(src), "--output-prefix", str(folder / name), "--workers", "0"]
    assert preprocess_main(args + (["--append-eod"] if eod else [])) == 0
    return folder / f"{name}_text_document"


@pytest.fixture(scope="module")
def small(corpus, tmp_path_factory):
    """A 10-document corpus (the size at which split 98,1,1 leaves validation and test empty),
    a second dataset, and a data config in its own folder with relative prefixes."""
    root = tmp_path_factory.mktemp("small")
    lines = corpus["src"].read_text().splitlines(keepends=True)
    (root / "data").mkdir()
    ten = _preprocess(root / "data", "rp", lines[:10])
    other = _preprocess(root / "data", "other", lines[10:40])
    (root / "data-rp.yaml").write_text("blend:\n  - {prefix: data/rp_text_document, weight: 1}\n"
                                       "split: '98,1,1'\n")
    return {"root": root, "ten": ten, "other": other, "yaml": root / "data-rp.yaml"}


def test_a_read_split_without_documents_is_refused_before_any_process_group(small, monkeypatch,
                                                                            capsys):
    monkeypatch.chdir(small["root"])
    began = time.monotonic()
    assert train_main([*TINY, "--data-path", "data-rp.yaml"]) == 2
    err = capsys.readouterr().err
    assert time.monotonic() - began < 30
    assert ("the validation split of " + str(small["ten"]) + " holds no documents: split 98,1,1 "
            "over its 10 documents gives train 10, validation 0, test 0") in err
    assert 'A split that works for this dataset: "9,1,0"' in err
    assert "--eval-interval 0 trains without validation" in err
    # the split it suggests is accepted; a train split with no documents is refused as well
    assert parse_run([*TINY, "--data-path", str(small["ten"]), "--split", "9,1,0"]).data.split == "9,1,0"
    with pytest.raises(ValueError, match="the train split of .* holds no documents"):
        parse_run([*TINY, "--data-path", str(small["ten"]), "--split", "0,1,0"])
    # fewer tokens than one sample: 1 document of a few tokens against seq_length 64
    with pytest.raises(ValueError, match=r"1 document\(s\) of \d+ tokens, fewer than one sample"):
        parse_run([*TINY, "--set", "seq_length=4096", "--data-path", str(small["ten"]),
                   "--split", "9,1,0"])


@pytest.mark.slow
def test_the_ten_document_corpus_trains_when_validation_is_off(small):
    """98,1,1 with --eval-interval 0: only the train split is read, so only it is built (before,
    megatron-core built the empty test and validation splits and looped forever)."""
    from aoe_megatron.runtime import launch

    for _ in range(2):  # a free port taken by another process meanwhile: once more
        done = launch.run([*TINY, "--data-path", "data-rp.yaml", "--eval-interval", "0",
                           "--run-dir", "run"], cwd=small["root"], timeout=120,
                          summary=small["root"] / "summary.json")
        if "EADDRINUSE" not in done.output:
            break
    assert done.returncode == 0, done.output[-2000:]
    assert sorted(done.summary()["losses"]) == [1, 2]


def test_megatron_lm_data_path_forms(small, monkeypatch):
    monkeypatch.chdir(small["root"])
    ten, other = str(small["ten"]), str(small["other"])
    one = parse_run([*TINY, "--data-path", "data/rp_text_document", "--split", "9,1,0"]).data
    assert one.prefixes == (ten,) and one.weights == (1.0,)  # absolute, from a relative prefix
    blend = parse_run([*TINY, "--data-path", "0.3", "data/rp_text_document", "0.7",
                       "data/other_text_document", "--split", "9,1,0"]).data
    assert blend.prefixes == (ten, other) and blend.weights == (0.3, 0.7)
    by_size = parse_run([*TINY, "--data-path", ten, other, "--split", "9,1,0"]).data
    sizes = [os.path.getsize(f"{p}.bin") // 2 for p in (ten, other)]  # uint16 tokens
    assert by_size.weights == tuple(float(s) for s in sizes)
    per_split = parse_run([*TINY, "--train-data-path", other, "--valid-data-path", ten,
                           "--test-data-path", ten]).data
    assert per_split.train_blend == ([other], [1.0]) and per_split.valid_blend == ([ten], [1.0])
    assert per_split.test_blend == ([ten], [1.0]) and per_split.split is None
    assert per_split.roles() == ["blend", "valid_blend", "test_blend"]
    # a checkpoint's record of the data names absolute prefixes that load from any folder
    assert DataConfig.load(per_split.to_dict()) == per_split
    for argv, message in [
        (["--data-path", "data-rp.yaml", "--split", "9,1,0"], "--split with a data config"),
        (["--data-path", ten, "--train-data-path", ten], "exclude each other"),
        (["--valid-data-path", ten], "need --train-data-path"),
        (["--train-data-path", ten, "--split", "9,1,0"], "--split applies to --data-path"),
        (["--data-path", "0.5", ten, "0.5"], "weights and prefixes alternating"),
        (["--data-path", ten, "--mock-data"], "--data-path and --mock-data exclude each other"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_run([*TINY, *argv])


def test_each_path_mistake_has_its_own_message(small, tmp_path, monkeypatch):
    monkeypatch.chdir(small["root"])
    cases = [
        ("data/rp_text_document.bin", "is one of a dataset's files: give its prefix, "
                                      "data/rp_text_document"),
        ("data/rp", f"did you mean {small['root']}/data/rp_text_document\\? aoe-preprocess"),
        ("data/rp_text_documen", f"the nearest dataset there is {small['root']}/data/rp_text_document"),
        ("nowhere/x", "the folder .*nowhere does not exist"),
        ("missing.yaml", r"no data config missing.yaml: no such file \(the package ships"),
    ]
    for value, message in cases:
        with pytest.raises(ValueError, match=message):
            parse_run([*TINY, "--data-path", value, "--split", "9,1,0"][:-2 if value.endswith("yaml") else None])
    # megatron-core's index cache makes a folder named like the prefix: still a prefix, not a YAML
    (small["root"] / "data" / "rp_text_document" / "cache").mkdir(parents=True, exist_ok=True)
    assert parse_run([*TINY, "--data-path", "data/rp_text_document", "--split", "9,1,0"]).data
    # a data config used from another folder: its relative prefixes resolve against its own folder
    monkeypatch.chdir(tmp_path)
    cfg = DataConfig.load(small["yaml"])
    assert cfg.prefixes == (str(small["ten"]),)
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "bad.yaml").write_text("blend:\n  - {prefix: data/typo_document, weight: 1}\n")
    with pytest.raises(ValueError, match=rf"blend: no dataset data/typo_document: tried "
                                         rf"{tmp_path}/data/typo_document.bin/.idx, "
                                         rf"{tmp_path}/cfg/data/typo_document.bin/.idx"):
        DataConfig.load(tmp_path / "cfg" / "bad.yaml")
    # a prefix whose .idx/.bin exist without a manifest: what to do about it
    bare = tmp_path / "bare_text_document"
    for ext in (".bin", ".idx"):
        (bare.parent / f"{bare.name}{ext}").write_bytes(Path(f"{small['ten']}{ext}").read_bytes())
    with pytest.raises(FileNotFoundError, match="--adopt .* or train on it unadopted with "
                                                "--no-manifest"):
        parse_run([*TINY, "--data-path", str(bare), "--split", "9,1,0"])
    # the package's data configs are found by file name from any folder
    with pytest.raises(ValueError, match=r"no dataset data/shakespeare_text_document: tried "):
        DataConfig.load("data-shakespeare.yaml")


def test_a_megatron_lm_corpus_trains_unadopted_with_no_manifest(small, tmp_path, capsys):
    """A corpus written by megatron-core's IndexedDatasetBuilder, as Megatron-LM's
    preprocess_data.py writes it: refused without a manifest, accepted with --no-manifest."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from aoe_megatron.data.tokenizer import Tokenizer

    tok = Tokenizer()
    prefix = tmp_path / "mlm_text_document"
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for text in small["root"].joinpath("data", "rp.jsonl").read_text().splitlines():
        builder.add_item(torch.tensor([*tok.encode([json.loads(text)["text"]])[0], tok.eos_id]))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    argv = [*TINY, "--data-path", str(prefix), "--split", "9,1,0"]
    with pytest.raises(FileNotFoundError, match="not written by aoe-preprocess"):
        parse_run(argv)
    run = parse_run([*argv, "--no-manifest"])
    assert run.manifest["policy"]["append_eod"] and run.manifest["documents"] == 10
    assert "WARNING: --no-manifest" in capsys.readouterr().err


def test_a_corpus_without_eod_is_refused_before_training(small, tmp_path, capsys):
    lines = small["root"].joinpath("data", "rp.jsonl").read_text().splitlines(keepends=True)
    from aoe_megatron.cli.preprocess import main as preprocess_main

    (tmp_path / "x.jsonl").write_text("".join(lines))
    assert preprocess_main(["--input", str(tmp_path / "x.jsonl"), "--output-prefix",
                            str(tmp_path / "x"), "--workers", "0"]) == 0
    assert "WARNING: no EOD token was appended" in capsys.readouterr().err
    assert train_main([*TINY, "--data-path", str(tmp_path / "x_text_document"), "--split",
                       "9,1,0"]) == 2
    assert "without an EOD token after each" in capsys.readouterr().err


def _wait_listening(port: int, proc, timeout: float = 180) -> None:
    """Until something listens on TCP ``port`` (rank 0's rendezvous store: /proc/net/tcp's LISTEN
    state, 0A), however long the imports take on a loaded machine; the process must not end."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            rows = Path(table).read_text().splitlines()[1:] if Path(table).exists() else []
            if any(r.split()[1].endswith(f":{port:04X}") and r.split()[3] == "0A" for r in rows):
                return
        time.sleep(0.2)
    raise AssertionError(f"nothing listened on port {port} within {timeout} s")


@pytest.mark.slow
def test_a_process_stuck_before_its_first_step_ends_on_sigint_and_sigterm(tmp_path):
    """Rank 0 of a world of 2 whose peer never comes waits in the rendezvous (C++): SIGINT, and
    SIGTERM before the first step, end it (130, 143) within the grace period."""
    from aoe_megatron.runtime import launch
    from aoe_megatron.runtime.distributed import free_port

    grace, procs, procs_env = 1.0, {}, {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        env = procs_env[sig] = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
                                "AOE_STOP_GRACE_S": str(grace)}
        procs[sig] = launch.start(["--preset", "tiny", "--mock-data", "--train-iters", "2",
                                   "--run-dir", tmp_path / sig.name], env=env, cwd=ROOT)
    for sig, proc in procs.items():  # past the imports, into the rendezvous: rank 0 listens
        _wait_listening(int(procs_env[sig]["MASTER_PORT"]), proc)
    for sig, proc in procs.items():
        assert proc.poll() is None, proc.stdout.read()
        proc.send_signal(sig)
    sent = time.monotonic()
    for sig, proc in procs.items():
        try:
            proc.wait(timeout=grace + 20)
        finally:
            proc.kill()
        output = proc.stdout.read()
        assert proc.returncode == 128 + sig, output
        assert f"{sig.name}: ended before the run finished" in output or "ending it now" in output
    assert time.monotonic() - sent < grace + 20


def test_shutdown_after_a_signal_during_megatron_cores_imports_loads_nothing():
    """A SIGINT that lands while megatron-core is still loading (a loaded machine's slow imports)
    must end the process with the signal's status: shutdown() then finds nothing to tear down
    and must not import megatron-core again from its half-loaded modules (it did, and that
    ImportError replaced the signal; here importing it is made to fail outright)."""
    script = ("import sys; sys.modules['megatron.core'] = None; "
              "sys.modules.pop('megatron.core.parallel_state', None); "
              "from aoe_megatron.runtime.distributed import shutdown; shutdown(); print('ok')")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_a_checkpoints_data_record_is_found_from_any_folder(small, tmp_path, monkeypatch):
    """The run record (config.json, every checkpoint's state.json) names the data by absolute
    prefixes, so the HF export finds the tokenizer's manifest from another folder."""
    from aoe_megatron.hf.to_hf import data_manifest

    monkeypatch.chdir(small["root"])
    record = parse_run([*TINY, "--data-path", "data/rp_text_document", "--split", "9,1,0"]).record()
    assert record["data"]["blend"] == [{"prefix": str(small["ten"]), "weight": 1.0}]
    monkeypatch.chdir(tmp_path)
    state = json.loads(json.dumps({"config": record}, default=str))  # as state.json holds it
    assert data_manifest(state)["documents"] == 10


def test_a_forked_childs_signals_stay_in_the_child():
    """A child forked during training (megatron's checkpoint writers, a worker pool) inherits
    the wakeup fd and the handlers: a SIGTERM to it must neither reach the trainer's watchdog nor
    end the child (a writer must outlive the SIGTERM Slurm sends every process of the step)."""
    script = """
import importlib.util, os, signal, sys, time
spec = importlib.util.spec_from_file_location("signals", sys.argv[1])  # not the whole package
signals = importlib.util.module_from_spec(spec)
spec.loader.exec_module(signals)
def child_of_sigterm(stop, training):
    stop.training = training
    pid = os.fork()
    if pid == 0:
        time.sleep(3)
        os._exit(7)
    time.sleep(0.3)
    os.kill(pid, signal.SIGTERM)
    _, status = os.waitpid(pid, 0)
    time.sleep(1.0)  # the watchdog's grace, five times over
    return os.waitstatus_to_exitcode(status)
with signals.StopSignals(grace_s=0.2) as stop:
    before = child_of_sigterm(stop, False)  # before training, the child ends (Interrupted)
    during = child_of_sigterm(stop, True)   # during training, it outlives the SIGTERM
    print("children", before, during, "parent alive", stop.raised)
"""
    out = subprocess.run([sys.executable, "-c", script,
                          str(ROOT / "aoe_megatron" / "runtime" / "signals.py")],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0 and "children 1 7 parent alive False" in out.stdout, (
        out.stdout + out.stderr[-2000:])
