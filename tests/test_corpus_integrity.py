"""Corpus integrity (issue #24): preprocessing records each file's size and sha256; every launch
checks the sizes and the .idx against the .bin before any process group starts; aoe-verify-data
checks every byte. Damaged files are refused by name."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from aoe_megatron.cli import verify_data
from aoe_megatron.train.loop import main as train_main

NAME = "d_text_document"


@pytest.fixture
def dataset(corpus, tmp_path):
    """A private copy of the session corpus's dataset, and a data config naming it."""
    for ext in (".bin", ".idx", ".manifest.json"):
        shutil.copy(f"{corpus['prefix']}{ext}", tmp_path / f"{NAME}{ext}")
    data = tmp_path / "data.yaml"
    data.write_text(f"blend:\n  - {{prefix: {tmp_path / NAME}, weight: 1}}\nsplit: '90,10,0'\n")
    return tmp_path / NAME, data


def _launch(data, capsys) -> str:
    """The train command's checks only: it is refused (exit 2) before any process group."""
    assert train_main(["--preset", "tiny", "--data-path", str(data), "--train-iters", "1"]) == 2
    return capsys.readouterr().err


def _manifest(prefix) -> dict:
    return json.loads(Path(f"{prefix}.manifest.json").read_text())


def test_preprocessing_records_the_size_and_sha256_of_both_files(dataset):
    prefix, _ = dataset
    files = _manifest(prefix)["files"]
    for ext in ("bin", "idx"):
        raw = Path(f"{prefix}.{ext}").read_bytes()
        assert files[ext] == {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}


def test_a_truncated_bin_is_refused_before_training_with_both_sizes(dataset, capsys):
    prefix, data = dataset
    raw = Path(f"{prefix}.bin").read_bytes()
    Path(f"{prefix}.bin").write_bytes(raw[: len(raw) // 2])
    err = _launch(data, capsys)
    assert (f"{prefix}.bin has {len(raw) // 2} bytes, the manifest says {len(raw)} (an "
            f"interrupted copy?)") in err, err


def test_a_truncated_idx_is_refused(dataset, capsys):
    prefix, data = dataset
    raw = Path(f"{prefix}.idx").read_bytes()
    Path(f"{prefix}.idx").write_bytes(raw[:-8])
    err = _launch(data, capsys)
    assert f"{prefix}.idx has {len(raw) - 8} bytes, the manifest says {len(raw)}" in err, err


def test_an_idx_that_disagrees_with_its_bin_is_refused(dataset, capsys):
    prefix, data = dataset
    raw = bytearray(Path(f"{prefix}.idx").read_bytes())
    raw[17] = 4  # the dtype code: int32 where the tokens are uint16 (same size, other header)
    Path(f"{prefix}.idx").write_bytes(bytes(raw))
    err = _launch(data, capsys)
    assert f"{prefix}.idx says its tokens are int32, the manifest says uint16" in err, err
    assert f"{prefix}.idx indexes" in err and "the two files are not one dataset" in err, err


def test_an_old_manifest_loads_with_a_note_and_its_idx_is_still_checked(dataset, capsys):
    prefix, data = dataset
    manifest = _manifest(prefix)
    del manifest["files"]
    Path(f"{prefix}.manifest.json").write_text(json.dumps(manifest))
    raw = Path(f"{prefix}.bin").read_bytes()
    Path(f"{prefix}.bin").write_bytes(raw[:-2])  # no recorded size: the .idx still catches it
    err = _launch(data, capsys)
    assert "predate recorded sizes and hashes" in err and err.count("note:") == 1, err
    assert f"but {prefix}.bin has {len(raw) - 2}" in err, err


def test_verify_catches_a_bin_of_the_same_size_from_another_corpus(dataset, capsys):
    prefix, data = dataset
    assert verify_data.main([str(data)]) == 0
    assert f"{prefix}: ok" in capsys.readouterr().out
    raw = bytearray(Path(f"{prefix}.bin").read_bytes())
    raw[len(raw) // 2: len(raw) // 2 + 2] = b"\x07\x00"  # one other token: same size, same index
    Path(f"{prefix}.bin").write_bytes(bytes(raw))
    assert verify_data.main([str(prefix)]) == 1
    out = capsys.readouterr().out
    assert f"{prefix}.bin does not match the sha256 its manifest recorded" in out, out
    assert "0 of 1 dataset(s) verify" in out
