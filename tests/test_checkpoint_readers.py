"""Checkpoint integrity at every reader (issue #24): ``--load-weights``, the HF export and the
study's tools refuse a checkpoint whose files do not match its manifest, before they load or write
anything, naming each damaged file; ``--no-verify`` reads it anyway with a warning; an imported
checkpoint carries a manifest that verifies."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from aoe_megatron.checkpoint import integrity

ROOT = Path(__file__).resolve().parents[1]
NO_VERIFY_WARNING = "--no-verify: reading {} without checking its files"


def _flip_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _small_checkpoint(path: Path, state: dict) -> Path:
    """A step folder of made-up files with its manifest (the readers only hash files)."""
    (path / "model").mkdir(parents=True)
    (path / "optimizer").mkdir()
    (path / "model" / "__0_0.distcp").write_bytes(bytes(range(256)) * 64)
    (path / "optimizer" / "__0_0.distcp").write_bytes(bytes(range(256)) * 16)
    (path / "state.json").write_text(json.dumps(state))
    integrity.write_manifest(path)
    return path


# ----------------------------------------------------------------------------- the one check


def test_every_problem_is_named_with_the_ways_on(tmp_path):
    step = _small_checkpoint(tmp_path / "step_00000002", {"format": 2, "step": 2})
    weights, moments = step / "model" / "__0_0.distcp", step / "optimizer" / "__0_0.distcp"
    _flip_middle_byte(weights)
    moments.write_bytes(moments.read_bytes()[:1000])
    (step / "state.json").unlink()
    with pytest.raises(integrity.CheckpointDamaged) as caught:
        integrity.require_verified(step, what="the reader", log=None)
    message = str(caught.value)
    assert f"checkpoint {step} is damaged, so the reader refused it" in message, message
    assert f"{weights} does not match its sha256" in message, message
    assert f"{moments} has 1000 bytes, the manifest says 4096" in message, message
    assert f"{step / 'state.json'} is missing" in message, message
    assert "restore these files" in message and "--no-verify" in message, message
    assert "\n" not in message  # one line after "error: "
    # the command-line tools catch ValueError (exit 2); the train command halts (exit 3: see
    # test_load_weights_refuses_a_damaged_checkpoint_and_trains_nothing)
    assert isinstance(caught.value, ValueError)


def test_no_verify_reads_unchecked_with_one_warning(tmp_path):
    step = _small_checkpoint(tmp_path / "step_00000002", {"format": 2})
    _flip_middle_byte(step / "model" / "__0_0.distcp")
    lines = []
    integrity.require_verified(step, verify=False, what="the reader", log=lines.append)
    assert len(lines) == 1 and NO_VERIFY_WARNING.format(step) in lines[0], lines


def test_a_checkpoint_without_manifest_is_refused_unless_it_predates_manifests(tmp_path):
    current = _small_checkpoint(tmp_path / "current", {"format": 2})
    (current / "manifest.json").unlink()
    with pytest.raises(integrity.CheckpointDamaged, match="has no manifest.json"):
        integrity.require_verified(current, what="the reader", log=None)

    format1 = _small_checkpoint(tmp_path / "format1", {"step": 4})
    (format1 / "manifest.json").unlink()
    (format1 / "optim_rank0.pt").write_bytes(b"")
    old_import = _small_checkpoint(tmp_path / "old_import", {"step": 0, "weights_only": True})
    (old_import / "manifest.json").unlink()
    for step in (format1, old_import):
        lines = []
        integrity.require_verified(step, what="the reader", log=lines.append)
        assert len(lines) == 1 and lines[0].startswith(f"note: {step} has no manifest.json"), lines


def test_a_good_checkpoint_passes_silently(tmp_path):
    step = _small_checkpoint(tmp_path / "step_00000002", {"format": 2})
    lines = []
    integrity.require_verified(step, what="the reader", log=lines.append)
    assert lines == []


# ----------------------------------------------------------------------------- the readers


@pytest.fixture(scope="module")
def damaged(trained_checkpoint, tmp_path_factory) -> dict:
    """A copy of the trained AoE checkpoint with one weight file's middle byte flipped (size
    unchanged: only the sha256 tells). Read it, do not write into it."""
    step = tmp_path_factory.mktemp("damaged") / "ckpt" / trained_checkpoint("aoe").name
    shutil.copytree(trained_checkpoint("aoe"), step)
    shard = sorted((step / "model").glob("*.distcp"))[0]
    _flip_middle_byte(shard)
    return {"step": step, "shard": shard}


@pytest.fixture(scope="module")
def exported(trained_checkpoint, tmp_path_factory) -> Path:
    """The undamaged trained AoE checkpoint exported to a Hugging Face folder (once)."""
    from aoe_megatron.hf.convert import export_to_hf

    return export_to_hf(trained_checkpoint("aoe"), tmp_path_factory.mktemp("hf") / "aoe", log=None)


def _no_output(parent: Path, name: str) -> None:
    assert not (parent / name).exists()
    assert not [p.name for p in parent.iterdir() if p.name.startswith(f"{name}.partial-")]


@pytest.mark.slow
@pytest.mark.distributed
def test_export_refuses_a_damaged_checkpoint_and_writes_nothing(damaged, tmp_path, capsys):
    from aoe_megatron.cli import convert_to_hf

    code = convert_to_hf.main(["--checkpoint", str(damaged["step"]), "--output",
                               str(tmp_path / "hf")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"error: checkpoint {damaged['step']} is damaged" in err, err
    assert f"{damaged['shard']} does not match its sha256" in err, err
    _no_output(tmp_path, "hf")

    try:  # the garbage may export or fail further on; only the check is skipped
        convert_to_hf.main(["--checkpoint", str(damaged["step"]), "--output",
                            str(tmp_path / "anyway"), "--no-verify"])
    except Exception:  # noqa: BLE001 (a reader's own error on the flipped byte)
        pass
    out = capsys.readouterr()
    assert NO_VERIFY_WARNING.format(damaged["step"]) in out.out, out
    assert "is damaged" not in out.err, out.err


@pytest.mark.slow
@pytest.mark.distributed
def test_the_study_refuses_a_damaged_checkpoint(damaged, corpus, tmp_path, capsys):
    from aoe_megatron.cli import norm_probe
    from aoe_megatron.study import evaluate, probe

    named = f"{damaged['shard']} does not match its sha256"
    with pytest.raises(integrity.CheckpointDamaged, match="the evaluation refused") as caught:
        evaluate.open_model(damaged["step"])
    assert named in str(caught.value)
    with pytest.raises(integrity.CheckpointDamaged, match="the norm probe refused") as caught:
        probe.probe_checkpoint(damaged["step"], torch.zeros(2, 9, dtype=torch.long))
    assert named in str(caught.value)

    output = tmp_path / "probe.json"
    code = norm_probe.main([str(damaged["step"]), "--data", str(corpus["data"]),
                            "--output", str(output)])
    err = capsys.readouterr().err
    assert code == 2 and named in err and "aoe-norm-probe refused" in err, err
    assert not output.exists()


@pytest.mark.slow
@pytest.mark.distributed
def test_load_weights_refuses_a_damaged_checkpoint_and_trains_nothing(damaged, tmp_path):
    from aoe_megatron.runtime import launch

    run = launch.run(["--preset", "tiny", "--mock-data", "--train-iters", "1",
                      "--load-weights", damaged["step"], "--save", tmp_path / "ck",
                      "--run-dir", tmp_path / "run"], nproc=1, cwd=ROOT, timeout=300)
    assert run.returncode == 3, run.output[-4000:]  # loop.EXIT_HALTED
    assert f"error: checkpoint {damaged['step']} is damaged, so --load-weights refused it" \
        in run.output, run.output[-4000:]
    assert f"{damaged['shard']} does not match its sha256" in run.output, run.output[-4000:]
    halted = json.loads((tmp_path / "run" / "halted.json").read_text())
    assert halted["reason"] == "CheckpointDamaged", halted
    assert not list((tmp_path / "ck").glob("step_*"))
    assert not (tmp_path / "run" / "run.json").exists()  # refused in set-up: no step began


@pytest.mark.slow
@pytest.mark.distributed
def test_an_imported_checkpoint_verifies_and_exports(exported, corpus, tmp_path, megatron_world):
    from aoe_megatron.hf.convert import export_to_hf, import_from_hf

    step = import_from_hf(exported, tmp_path / "back", log=None)
    manifest = integrity.read_checkpoint_manifest(step)
    assert manifest is not None and "state.json" in manifest["files"], manifest
    assert any(name.startswith("model/") for name in manifest["files"]), manifest
    assert integrity.verify(step) == []
    lines = []
    export_to_hf(step, tmp_path / "again", data=corpus["data"], log=lines.append)
    assert (tmp_path / "again" / "config.json").is_file()
    assert not [line for line in lines if line.startswith(("note:", "WARNING"))], lines
