"""Resume at another parallel layout (issue #13): a checkpoint written at world W / EP e resumes at
W' / e' with weights, Adam moments, step, schedule and data position, and the next 5 losses equal
those of the run that continued at the original layout. Resetting the moments must change them.

Everything runs through the real entry point (aoe_megatron.runtime.launch: torchrun for two or
more processes, ``python -m aoe_megatron.train`` for one; gloo, DeepSpeed ZeRO).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from aoe_megatron.runtime import launch
from tests.helpers import run_distributed

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[1]
SAVE_AT, STEPS = 3, 11  # checkpoints at steps 3, 6, 9 and 11; at least 5 steps after a resume
SETTINGS = ["--preset", "tiny", "--set", "vocab_size=512", "--global-batch-size", "4",
            "--micro-batch-size", "1", "--lr-warmup-iters", "2", "--lr", "3e-3", "--eval-interval",
            "0", "--log-interval", "1", "--mock-data", "--train-iters", str(STEPS),
            "--save-interval", str(SAVE_AT)]
TOL = 1e-5
# bf16: the resumed run sums the same fp32 gradients in another order (another world size and
# optimizer), so its bf16 weights can round the other way; seen: at most 6e-5 (2026-12-04). A
# resume without the Adam moments moves the loss by more than 1e-3 (the fp32 test below).
BF16_TOL = 2e-4


def _train(tmp: Path, name: str, *, world: int, ep: int, zero: int = 2, ckpt: Path,
           extra: tuple = ()) -> dict:
    run = launch.run([*SETTINGS, "--expert-model-parallel-size", ep, "--zero-stage", zero,
                      "--ckpt-dir", ckpt, "--run-dir", tmp / f"run_{name}", *extra],
                     nproc=world, threads=1, cwd=ROOT, timeout=600, summary=tmp / f"{name}.json")
    assert run.returncode == 0, run.output[-12000:]
    result = run.summary()
    result["log"] = run.output
    result["ckpt"] = ckpt
    return result


def _checkpoint_copy(src: Path, dst: Path, step: int) -> Path:
    """A ckpt dir holding only ``src``'s checkpoint of ``step``."""
    name = f"step_{step:08d}"
    dst.mkdir(parents=True)
    shutil.copytree(src / name, dst / name)
    (dst / "latest").write_text(name + "\n")
    return dst


def _resumed(tmp: Path, name: str, source: Path, *, world: int, ep: int, zero: int = 2,
             step: int = SAVE_AT, extra: tuple = ()) -> dict:
    result = _train(tmp, name, world=world, ep=ep, zero=zero,
                    ckpt=_checkpoint_copy(source, tmp / f"ck_{name}", step), extra=extra)
    assert result["start"] == step, result["log"][-3000:]
    return result


def _assert_same_continuation(resumed: dict, original: dict, tol: float = TOL) -> None:
    """Every step after the resume (at least 5) has the loss of the run that went on at the
    checkpoint's own layout."""
    steps = sorted(resumed["losses"])
    assert steps == list(range(resumed["start"] + 1, STEPS + 1)) and len(steps) >= 5
    for step in steps:
        assert abs(resumed["losses"][step] - original["losses"][step]) <= tol, (
            step, resumed["losses"], original["losses"])


@pytest.fixture(scope="module")
def from_world2_ep2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("w2")
    reference = _train(tmp, "reference", world=2, ep=2, ckpt=tmp / "ck_reference")
    assert sorted(reference["losses"]) == list(range(1, STEPS + 1))
    return tmp, reference


@pytest.mark.legs
@pytest.mark.slow
def test_world2_ep2_resumes_at_world1_ep1(from_world2_ep2):
    tmp, reference = from_world2_ep2
    resumed = _resumed(tmp, "w1", tmp / "ck_reference", world=1, ep=1)
    assert "world size 2 -> 1, EP 2 -> 1" in resumed["log"], resumed["log"][-3000:]
    _assert_same_continuation(resumed, reference)


@pytest.mark.legs
@pytest.mark.slow
def test_world2_ep2_resumes_at_world4_ep2_zero1_and_back(from_world2_ep2):
    """World 2 -> 4 (and ZeRO-2 -> 1), then the reverse: the world-4 run's own checkpoint of step
    6 resumes at world 2 / ZeRO-2 and continues as the world-4 run did."""
    tmp, reference = from_world2_ep2
    wide = _resumed(tmp, "w4", tmp / "ck_reference", world=4, ep=2, zero=1)
    assert "world size 2 -> 4, ZeRO stage 2 -> 1" in wide["log"], wide["log"][-3000:]
    assert "gradient accumulation 2 -> 1 micro-batches per rank" in wide["log"]
    _assert_same_continuation(wide, reference)
    back = _resumed(tmp, "w4_to_w2", wide["ckpt"], world=2, ep=2, zero=2, step=2 * SAVE_AT)
    assert "world size 4 -> 2, ZeRO stage 1 -> 2" in back["log"], back["log"][-3000:]
    _assert_same_continuation(back, wide)


def _zero_adam_moments(checkpoint: Path) -> None:
    """Rewrite a checkpoint's optimizer shards with the Adam moments set to zero (and a new
    manifest, so it still verifies)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    from aoe_megatron.checkpoint import integrity

    optim = checkpoint / "optimizer"
    flat = checkpoint.parent / "optimizer.pt"
    dcp_to_torch_save(str(optim), str(flat))
    state = torch.load(flat, weights_only=True)
    moments = [k for k in state if k.startswith(("optimizer.exp_avg.", "optimizer.exp_avg_sq."))]
    assert moments and any(state[k].abs().sum() > 0 for k in moments)
    for key in moments:
        state[key].zero_()
    torch.save(state, flat)
    keep = {p.name: p.read_bytes() for p in optim.iterdir() if p.name in ("metadata.json", "common.pt")}
    shutil.rmtree(optim)
    torch_save_to_dcp(str(flat), str(optim))
    for name, data in keep.items():
        (optim / name).write_bytes(data)
    flat.unlink()
    integrity.write_manifest(checkpoint)


@pytest.mark.slow
def test_resetting_the_adam_moments_changes_the_continuation(from_world2_ep2):
    """The resumes above match because the moments are restored: without them they do not."""
    tmp, reference = from_world2_ep2
    ckpt = _checkpoint_copy(tmp / "ck_reference", tmp / "ck_reset", SAVE_AT)
    _zero_adam_moments(ckpt / f"step_{SAVE_AT:08d}")
    reset = _train(tmp, "reset", world=1, ep=1, ckpt=ckpt)
    assert reset["start"] == SAVE_AT
    # The first step after the resume runs on the restored weights: same loss. Every later one
    # follows an Adam update without the moments.
    first = SAVE_AT + 1
    assert abs(reset["losses"][first] - reference["losses"][first]) <= TOL
    later = [abs(reset["losses"][s] - reference["losses"][s]) for s in range(first + 1, STEPS + 1)]
    assert max(later) > 100 * TOL, (reset["losses"], reference["losses"])


@pytest.mark.legs
@pytest.mark.slow
def test_zero3_checkpoint_resumes_at_another_world_size(tmp_path):
    """ZeRO-3 (EP = 1 only): parameters are partitioned too; they are gathered to save and follow
    the restored fp32 masters on load."""
    reference = _train(tmp_path, "reference", world=2, ep=1, zero=3, ckpt=tmp_path / "ck_reference")
    resumed = _resumed(tmp_path, "w1", tmp_path / "ck_reference", world=1, ep=1, zero=3)
    assert "world size 2 -> 1" in resumed["log"], resumed["log"][-3000:]
    _assert_same_continuation(resumed, reference)


BF16 = ("--precision", "bf16")


@pytest.mark.slow
def test_bf16_checkpoints_resume_across_optimizers_and_layouts(tmp_path):
    """bf16 with fp32 gradient accumulation: ZeRO-1 runs as DeepSpeed's BF16_Optimizer, ZeRO-2 as
    its ZeRO optimizer with fp32 gradient partitions. A BF16_Optimizer checkpoint at world 2 /
    EP 2 resumes under ZeRO-2 at world 1 / EP 1, continuing as the original run did (to
    bf16's rounding: the world-1 run sums the same fp32 gradients in another order)."""
    reference = _train(tmp_path, "reference", world=2, ep=2, zero=1, ckpt=tmp_path / "ck_reference",
                       extra=BF16)
    narrow = _resumed(tmp_path, "w1", tmp_path / "ck_reference", world=1, ep=1, zero=2, extra=BF16)
    assert "world size 2 -> 1, EP 2 -> 1, ZeRO stage 1 -> 2" in narrow["log"], narrow["log"][-3000:]
    _assert_same_continuation(narrow, reference, tol=BF16_TOL)


def _rng_round_trip(rank, world_size):
    import torch
    from megatron.core import tensor_parallel

    from aoe_megatron.checkpoint import optim_state

    def draws():
        with tensor_parallel.get_cuda_rng_tracker().fork():
            forked = torch.rand(4)
        return torch.cat([torch.rand(4), forked])

    saved = optim_state.rng_state()
    first = draws()
    assert not torch.equal(first, draws())  # the streams move on
    optim_state.set_rng_state(saved)
    torch.testing.assert_close(first, draws(), rtol=0, atol=0)  # and come back exactly
    optim_state.reseed(1234, 10, rank)
    reseeded = draws()
    optim_state.reseed(1234, 10, rank)
    torch.testing.assert_close(reseeded, draws(), rtol=0, atol=0)
    assert not torch.equal(reseeded, first)


@pytest.mark.legs
def test_random_generators_are_restored_exactly():
    run_distributed(_rng_round_trip, 1)
