"""Checkpoint integrity (issue #13): manifests with sha256, verification naming the file at fault,
fallback to the newest checkpoint that verifies, and --keep-last retention."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import pytest

from aoe_megatron.checkpoint import integrity, layout
from aoe_megatron.runtime import hashing, launch
from aoe_megatron.checkpoint import resume as ckpt
from aoe_megatron.checkpoint.errors import CheckpointTooOld
from aoe_megatron.checkpoint.save import apply_retention
from aoe_megatron.train.resume_checks import ResumeError, check_config

ROOT = Path(__file__).resolve().parents[1]


def _fake_checkpoint(path: Path) -> Path:
    (path / "model").mkdir(parents=True)
    (path / "model" / "__0_0.distcp").write_bytes(bytes(range(256)) * 64)
    (path / "model" / "metadata.json").write_text('{"a": 1}')
    (path / "state.json").write_text("{}")
    integrity.write_manifest(path)
    return path


def test_a_fresh_checkpoint_verifies(tmp_path):
    path = _fake_checkpoint(tmp_path / "step_00000001")
    manifest = json.loads((path / "manifest.json").read_text())
    assert sorted(manifest["files"]) == ["model/__0_0.distcp", "model/metadata.json", "state.json"]
    assert manifest["files"]["model/__0_0.distcp"]["size"] == 256 * 64
    assert integrity.verify(path) == []


@pytest.mark.parametrize("damage,phrase", [
    ("flip", "does not match its sha256"),
    ("truncate", "has 8192 bytes, the manifest says 16384"),
    ("delete", "is missing"),
])
def test_damage_is_detected_and_named(tmp_path, damage, phrase):
    path = _fake_checkpoint(tmp_path / "step_00000001")
    shard = path / "model" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    if damage == "flip":
        data[5000] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(bytes(data[: len(data) // 2]))
    else:
        shard.unlink()
    problems = integrity.verify(path)
    assert len(problems) == 1 and str(shard) in problems[0] and phrase in problems[0], problems


def test_resume_rehashes_only_files_whose_stamp_changed(tmp_path, monkeypatch):
    """Resume's shortcut (issue #24): a file is hashed again only if its size, mtime or ctime
    changed since it was last hashed; readers without the shortcut hash everything."""
    monkeypatch.setattr(integrity, "THREADS", 3)  # hashed on threads: the same verdicts
    path = _fake_checkpoint(tmp_path / "step_00000001")
    shard = path / "model" / "__0_0.distcp"

    def resume_verify(root=path, **kw):
        stats = {}
        return integrity.verify(root, trust_stamps=True, stats=stats, **kw), stats

    problems, stats = resume_verify()
    assert problems == [] and stats["files"] == 3 and stats["hashed"] == 0  # hashed at save
    full = {}
    assert integrity.verify(path, stats=full) == [] and full["hashed"] == 3

    # same size, mtime put back: the ctime moved, so the corruption is hashed and caught
    good = shard.read_bytes()
    before = shard.stat()
    shard.write_bytes(bytes([good[0] ^ 0xFF]) + good[1:])
    os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
    problems, stats = resume_verify()
    assert stats["hashed"] == 1 and len(problems) == 1 and "sha256" in problems[0], problems
    problems, stats = resume_verify()  # a failed file is never recorded as verified
    assert stats["hashed"] == 1 and len(problems) == 1

    # repaired: hashed once more, recorded, then trusted
    shard.write_bytes(good)
    problems, stats = resume_verify()
    assert problems == [] and stats["hashed"] == 1 and resume_verify()[1]["hashed"] == 0

    # a copy has new stamps: hashed in full; another run's folder (record=False) is not written
    copy = tmp_path / "copy" / path.name
    shutil.copytree(path, copy)  # copy2 keeps the mtimes, not the ctimes
    recorded = (copy / integrity.STAMPS).read_text()
    for _ in range(2):
        problems, stats = resume_verify(copy, record=False)
        assert problems == [] and stats["hashed"] == 3
    assert (copy / integrity.STAMPS).read_text() == recorded
    problems, stats = resume_verify(copy)
    assert stats["hashed"] == 3 and resume_verify(copy)[1]["hashed"] == 0
    assert sorted(json.loads((path / "manifest.json").read_text())["files"]) == sorted(
        json.loads((copy / integrity.STAMPS).read_text()))  # the record is not in the manifest


@pytest.mark.parametrize("misuse", ["none", "seek", "truncate", "raise", "fd write"])
def test_a_hashing_writer_records_the_files_sha256_or_nothing(tmp_path, misuse):
    """Written through in order, the digest recorded is the file's; a seek, a truncate, an
    exception or a write around it through the descriptor leaves no digest and no record."""
    import torch

    path = tmp_path / "__0_0.distcp"
    with pytest.raises(OSError) if misuse == "raise" else contextlib.nullcontext():
        with hashing.open_recorded(path) as f:
            f.write(b"abc" * 1000)
            f.write(memoryview(bytearray(range(256))))
            torch.save(torch.arange(10), f)  # as torch's checkpoint writer does, through a wrapper
            if misuse == "seek":
                f.seek(10)
                f.write(b"x")
                f.seek(0, os.SEEK_END)
            elif misuse == "truncate":
                f.truncate(100)
            elif misuse == "raise":
                raise OSError("disk full (injected)")
            elif misuse == "fd write":
                f.flush()
                os.write(f.fileno(), b"around")
    recorded = hashing.recorded_sha256(path)
    if misuse == "none":
        assert recorded == hashing.sha256_file(path) and f.hexdigest() == recorded
    else:
        assert recorded is None and f.hexdigest() is None and not f.valid
        assert not hashing.record_path(path).exists()


def test_a_manifest_takes_recorded_digests_and_reads_only_the_other_files(tmp_path, monkeypatch):
    """write_manifest reads no file whose digest was recorded as it was written (issue #34), still
    hashes a file changed since its record, writes rank 0's in-memory files, and leaves no record
    behind; every digest is what a re-read gives."""
    root = tmp_path / "step_00000001.partial-x"
    (root / "model").mkdir(parents=True)
    with hashing.open_recorded(root / "model" / "__0_0.distcp") as f:
        f.write(os.urandom(1 << 20))
    changed = root / "model" / "__0_1.distcp"
    with hashing.open_recorded(changed) as f:
        f.write(b"x" * 100)
    before = changed.stat()
    changed.write_bytes(b"y" * 100)  # same size; its mtime moves on
    os.utime(changed, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000))
    (root / "model" / "metadata.json").write_text('{"a": 1}')
    (root / ("gone.distcp" + hashing.RECORD_SUFFIX)).write_text("{}")  # a record of no file
    read, real = [], integrity.sha256_file
    monkeypatch.setattr(integrity, "sha256_file", lambda p: read.append(Path(p).name) or real(p))
    manifest = integrity.write_manifest(root, written={"state.json": b'{"step": 1}\n'})
    assert sorted(read) == ["__0_1.distcp", "metadata.json"]
    assert sorted(manifest["files"]) == ["model/__0_0.distcp", "model/__0_1.distcp",
                                         "model/metadata.json", "state.json"]
    for name, entry in manifest["files"].items():
        assert entry == {"size": (root / name).stat().st_size, "sha256": real(root / name)}, name
    assert not list(root.rglob("*" + hashing.RECORD_SUFFIX))
    assert integrity.verify(root) == []


def test_a_missing_or_unreadable_manifest_is_refused(tmp_path):
    path = _fake_checkpoint(tmp_path / "step_00000001")
    (path / "manifest.json").write_text("{not json")
    assert "unreadable" in integrity.verify(path)[0]
    (path / "manifest.json").unlink()
    assert "has no manifest.json" in integrity.verify(path)[0]


def test_retention_keeps_the_newest_latest_and_last_verified(tmp_path):
    for step in range(1, 7):
        (tmp_path / f"step_{step:08d}").mkdir()
    (tmp_path / "step_00000007.partial-host-123").mkdir()
    (tmp_path / "latest").write_text("step_00000005\n")  # e.g. rolled back by hand
    (tmp_path / "last_verified").write_text("step_00000002\n")
    deleted = apply_retention(tmp_path, 2, log=lambda _: None)
    assert sorted(p.name for p in deleted) == ["step_00000001", "step_00000003",
                                               "step_00000004", "step_00000007.partial-host-123"]
    assert [p.name for p in layout.checkpoints(tmp_path)] == ["step_00000002", "step_00000005",
                                                            "step_00000006"]


def _train(tmp: Path, name: str, args: list, ckpt_dir: Path, *extra) -> launch.Finished:
    return launch.run([*args, "--ckpt-dir", ckpt_dir, "--run-dir", tmp / f"run_{name}", *extra],
                      nproc=2, threads=1, cwd=ROOT, timeout=600, summary=tmp / f"{name}.json")


@pytest.mark.slow
@pytest.mark.distributed
def test_corrupted_checkpoints_fall_back_to_the_newest_that_verifies(tiny_reference_run, tmp_path):
    ck, args = tmp_path / "ck", tiny_reference_run["args"]
    shutil.copytree(tiny_reference_run["ckpt"], ck)
    reference = tiny_reference_run["losses"]
    assert [p.name for p in layout.checkpoints(ck)] == [f"step_{s:08d}" for s in (2, 4, 6, 8)]

    # Three kinds of damage, newest first: a missing shard, a truncated file, flipped bytes.
    missing = ck / "step_00000008" / "optimizer" / "__1_0.distcp"
    missing.unlink()
    truncated = ck / "step_00000006" / "model" / "__0_0.distcp"
    truncated.write_bytes(truncated.read_bytes()[:1000])
    flipped = ck / "step_00000004" / "optimizer" / "__0_0.distcp"
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x01
    flipped.write_bytes(bytes(data))

    second = _train(tmp_path, "second", args, ck, "--keep-last", "1")
    out = second.output
    assert second.returncode == 0, out[-5000:]
    assert f"{missing} is missing" in out, out[-5000:]
    assert f"{truncated} has 1000 bytes" in out, out[-5000:]
    assert f"{flipped} does not match its sha256" in out, out[-5000:]
    assert "falling back to" in out and "step_00000002" in out
    summary = second.summary()
    losses, start = summary["losses"], summary["start"]
    assert start == 2
    for step in range(3, 9):  # same layout, same data: the uninterrupted run's losses
        assert abs(losses[step] - reference[step]) <= 1e-6, (step, losses, reference)
    # --keep-last 1 kept the newest (step 8, which `latest` names) and the last verified one.
    assert (ck / "last_verified").read_text().strip() == "step_00000002"
    assert [p.name for p in layout.checkpoints(ck)] == ["step_00000002", "step_00000008"]
    assert integrity.verify(ck / "step_00000008") == []

    # When no checkpoint verifies, nothing is loaded and the run does not start over.
    for shard in (ck / "step_00000002" / "model").glob("*.distcp"):
        shard.write_bytes(b"")
    (ck / "step_00000008" / "state.json").write_text("{}")
    third = _train(tmp_path, "third", args, ck)
    assert third.returncode != 0
    assert "no checkpoint in" in third.output and "verifies" in third.output


def test_the_verify_tool_names_damage_and_sets_its_exit_code(tmp_path, capsys):
    from aoe_megatron.cli import checkpoints as tool

    good = _fake_checkpoint(tmp_path / "step_00000001")
    bad = _fake_checkpoint(tmp_path / "step_00000002")
    (tmp_path / "latest").write_text("step_00000002\n")
    assert tool.main(["verify", str(good)]) == 0
    (bad / "state.json").write_text("{ }")
    assert tool.main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"{good}: OK" in out and f"{bad}: FAILED" in out and str(bad / "state.json") in out
    assert tool.main(["list", str(tmp_path)]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert listing[-1].startswith("step_00000002") and listing[-1].endswith("[latest]"), listing
    assert tool.main(["verify", str(tmp_path / "absent")]) == 2


def test_a_checkpoint_of_the_old_format_is_refused_with_the_way_out(tmp_path):
    old = tmp_path / "step_00000004"
    (old / "model").mkdir(parents=True)
    (old / "optim_rank0.pt").write_bytes(b"")
    (old / "state.json").write_text(json.dumps({"step": 4, "layout": {}}))
    with pytest.raises(CheckpointTooOld, match=f"--load-weights {old}"):
        ckpt.load_checkpoint(old, engine=None, model=None, scheduler=None, layout={})


def test_resume_refuses_another_model_or_global_batch_with_both_values():
    saved = {"config": {"model": {"num_layers": 2, "arch": "aoe", "top": [1, 2]},
                        "train": {"global_batch_size": 8}}}
    same = {"model": {"num_layers": 2, "arch": "aoe", "top": (1, 2)}, "train": {"global_batch_size": 8}}
    check_config(saved, same, "ck/step_00000002")  # tuples are lists in state.json
    other = {"model": {"num_layers": 4, "arch": "aoe", "top": (1, 2)}, "train": {"global_batch_size": 16}}
    with pytest.raises(ResumeError) as err:
        check_config(saved, other, "ck/step_00000002")
    assert "model.num_layers: 2 in the checkpoint, 4 now" in str(err.value)
    assert "train.global_batch_size: 8 in the checkpoint, 16 now" in str(err.value)
