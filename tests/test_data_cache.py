"""The data index cache (``--data-cache-path``, ``data/index_cache.py``): never written into the
corpus, read by every rank from one folder, built ahead by ``--build-data-index-only`` and then
reused by the job, and a clear error naming the path when a rank cannot write or read it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from aoe_megatron.data import index_cache
from aoe_megatron.data.blend import build_datasets
from aoe_megatron.train.run import parse_run

pytestmark = pytest.mark.legs  # megatron-core's dataset builder: both releases

TINY = ["--preset", "tiny", "--train-iters", "2", "--global-batch-size", "2",
        "--micro-batch-size", "1"]


def _listing(root: Path) -> dict:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")}


@pytest.mark.distributed
@pytest.mark.slow
def test_a_job_writes_its_index_beside_the_run_directory_not_into_the_corpus(corpus,
                                                                             trained_checkpoint):
    before = _listing(corpus["root"])
    step = trained_checkpoint("aoe")  # EP 2 over two processes: rank 0 builds, rank 1 reads
    assert _listing(corpus["root"]) == before
    assert not [p for p in before if "cache" in Path(p).parts], sorted(before)
    out = trained_checkpoint.runs["aoe"]["out"]
    assert step.parent.parent == out
    built = index_cache.index_files(out / index_cache.DEFAULT_NAME)  # beside out/run
    assert sum(n.endswith(".npy") for n in built) >= 3, built
    assert f"data index cache: {(out / index_cache.DEFAULT_NAME).resolve()}: built" in \
        trained_checkpoint.runs["aoe"]["output"]


@pytest.mark.distributed
@pytest.mark.slow
def test_a_prebuilt_index_is_reused_with_the_same_samples(trained_checkpoint):
    trained_checkpoint("aoe")
    trained_checkpoint("moe")  # its cache built ahead by --build-data-index-only --world-size 2
    moe, aoe = trained_checkpoint.runs["moe"], trained_checkpoint.runs["aoe"]
    prebuilt = moe["out"] / "prebuilt"
    assert "done in" in moe["build_output"] and moe["built"], moe["build_output"][-3000:]
    assert moe["after"] == moe["built"]  # the job rebuilt nothing and added nothing
    assert f"data index cache: {prebuilt.resolve()}: reused" in moe["output"]
    # the same settings at the same world size: the job of the aoe run built the very same files
    job_built = aoe["out"] / index_cache.DEFAULT_NAME
    assert sorted(index_cache.index_files(job_built)) == sorted(moe["built"])
    for name in moe["built"]:
        assert (job_built / name).read_bytes() == (prebuilt / name).read_bytes(), name


def test_default_path_is_the_same_on_every_rank(tmp_path):
    """Rank 0 alone resolves the run directory (SAVE/run, or a new runs/<time>-<preset>); the
    cache folder follows from the settings, so the other ranks name it alike."""
    cfg = parse_run([*TINY, "--mock-data", "--save", str(tmp_path / "ck")]).cfg
    assert index_cache.default_path(cfg) == str(tmp_path / "ck" / "data-cache")
    resolved = cfg.__class__(**{**cfg.__dict__, "run_dir": str(tmp_path / "ck" / "run")})
    assert index_cache.default_path(resolved) == index_cache.default_path(cfg)
    plain = parse_run([*TINY, "--mock-data"]).cfg
    assert index_cache.default_path(plain) == os.path.join("runs", "data-cache")
    given = parse_run([*TINY, "--mock-data", "--data-cache-path", "/shared/idx"]).cfg
    assert index_cache.default_path(given) == "/shared/idx"


def test_world_size_goes_with_build_only():
    with pytest.raises(ValueError, match="--world-size goes with --build-data-index-only"):
        parse_run([*TINY, "--mock-data", "--world-size", "8"])
    with pytest.raises(ValueError, match="--mock-data has none"):
        parse_run([*TINY, "--mock-data", "--build-data-index-only"])


def test_a_cache_folder_that_cannot_be_written_is_named(corpus, megatron_world, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(index_cache.DataCacheError, match=f"cannot write .*{blocker}"):
        build_datasets(corpus["data"], seq_length=16, seed=1, num_samples=(8, 0, 0),
                       cache_dir=str(blocker / "cache"))


def test_a_rank_that_cannot_see_rank_0s_cache_is_told_why(corpus, megatron_world, tmp_path,
                                                        monkeypatch):
    """Another node's rank (here: this process, told it is rank 1) finds none of the files rank
    0 wrote: per-node copies, or a node-local --data-cache-path."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    with pytest.raises(index_cache.DataCacheError,
                       match=r"rank 1 cannot read the data index cache .*every node sees"):
        build_datasets(corpus["data"], seq_length=16, seed=1, num_samples=(8, 0, 0),
                       cache_dir=str(tmp_path / "node-local"))


def test_without_a_cache_folder_nothing_is_written_beside_the_data(corpus, megatron_world):
    before = _listing(corpus["root"])
    train, _, _ = build_datasets(corpus["data"], seq_length=16, seed=1, num_samples=(8, 0, 0))
    assert len(train) >= 8 and train[0]["tokens"].shape[0] == 16
    assert _listing(corpus["root"]) == before
