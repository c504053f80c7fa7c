"""What the checkout builds and keeps: `make study-data`'s tokenizer size and file names (the
default 8,192 pieces and STUDY_VOCAB=2048, issue #35) against the data configs that read them; the
study's checkpoints and TensorBoard files ignored at any depth; no tracked file over 10 MB."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
MAX_TRACKED_BYTES = 10 * 1024 * 1024


def _make_dry_run(*variables: str) -> subprocess.CompletedProcess:
    """``make -n -B study-data`` in the checkout: every command printed (-B), none run (-n)."""
    if shutil.which("make") is None or not (ROOT / "Makefile").is_file():
        pytest.skip("needs make and the checkout's Makefile")
    # A parent make (make test STUDY_VOCAB=...) passes its variables down through MAKEFLAGS.
    env = {k: v for k, v in os.environ.items()
           if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "STUDY_VOCAB")}
    return subprocess.run(["make", "--no-print-directory", "-n", "-B", "study-data", *variables],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def _commands(output: str, tool: str) -> list:
    """Each printed command line of ``tool`` (continuations joined) as {flag: value}."""
    found = []
    for line in output.replace("\\\n", " ").splitlines():
        words = shlex.split(line)
        if words and Path(words[0]).name == tool:
            found.append({words[i]: words[i + 1] for i in range(1, len(words) - 1)
                          if words[i].startswith("--") and not words[i + 1].startswith("--")})
    return found


@pytest.mark.parametrize("variables,vocab,tokenizer,data,config", [
    ((), 8192, "assets/tokenizer/study8k", "data/study", "run/data-study.yaml"),
    (("STUDY_VOCAB=2048",), 2048, "assets/tokenizer/study2k", "data/study2k", "run/data-study-2k.yaml"),
])
def test_study_data_builds_the_tokenizer_and_splits_its_data_config_reads(
        variables, vocab, tokenizer, data, config):
    result = _make_dry_run(*variables)
    assert result.returncode == 0, result.stderr
    trained = _commands(result.stdout, "aoe-train-tokenizer")
    assert trained == [{"--input": "assets/corpus/study_train.jsonl", "--output-prefix": tokenizer,
                        "--vocab-size": str(vocab)}]  # the training split only
    tokenized = {c["--input"]: c for c in _commands(result.stdout, "aoe-preprocess")}
    assert sorted(tokenized) == ["assets/corpus/study_train.jsonl", "assets/corpus/study_valid.jsonl"]
    for split in ("train", "valid"):
        command = tokenized[f"assets/corpus/study_{split}.jsonl"]
        assert command["--tokenizer-model"] == f"{tokenizer}.model"
        assert command["--output-prefix"] == f"{data}_{split}"
    blends = yaml.safe_load((ROOT / config).read_text())
    assert set(blends) == {"blend", "valid_blend"}  # a held-out split, no `split:`
    assert [b["prefix"] for b in blends["blend"]] == [f"{data}_train_text_document"]
    assert [b["prefix"] for b in blends["valid_blend"]] == [f"{data}_valid_text_document"]


def test_study_data_refuses_a_vocabulary_it_cannot_name():
    result = _make_dry_run("STUDY_VOCAB=1000")
    assert result.returncode != 0 and "positive multiple of 1024" in result.stderr


def _git(*args: str) -> subprocess.CompletedProcess:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=ROOT, capture_output=True,
                         text=True)
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != ROOT:
        pytest.skip("not a git checkout of the project")
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, timeout=60)


def test_no_tracked_file_is_over_10_mb():
    """Checkpoints, corpora and wheels stay out of git: staged blobs and the working tree's
    tracked files alike."""
    staged = _git("ls-files", "-s", "-z").stdout.decode()
    blobs = {}
    for entry in filter(None, staged.split("\0")):
        meta, path = entry.split("\t", 1)
        mode, sha, _ = meta.split()
        if mode != "160000":  # a submodule's commit, not a file
            blobs[sha] = path
    sizes = subprocess.run(["git", "cat-file", "--batch-check=%(objectname) %(objectsize)"],
                           cwd=ROOT, input="\n".join(blobs) + "\n", capture_output=True,
                           text=True, check=True).stdout.split("\n")
    big = {blobs[sha]: int(size) for sha, size in (line.split() for line in sizes if line)
           if int(size) > MAX_TRACKED_BYTES}
    for path in blobs.values():
        file = ROOT / path
        if file.is_file() and not file.is_symlink() and file.stat().st_size > MAX_TRACKED_BYTES:
            big[path] = max(big.get(path, 0), file.stat().st_size)
    assert not big, {p: f"{s / 2**20:.1f} MiB" for p, s in big.items()}


IGNORED = ["studies/v2/runs/stage1/moe-lr1e-3/seed1/ckpt/step_000050/x.distcp",
           "studies/v2/runs/stage1/moe-lr1e-3/seed1/events.out.tfevents.1765000000.host.1.0",
           "studies/default/runs/moe/seed1/ckpt/a",  # the first study's depth
           "studies/default/runs/moe/seed1/events.out.tfevents.1765000000.host.1.0"]
KEPT = ["studies/v2/runs/stage1/moe-lr1e-3/seed1/metrics.jsonl",
        "studies/v2/runs/stage1/moe-lr1e-3/seed1/eval.json",
        "studies/default/runs/moe/seed1/metrics.jsonl", "studies/v2/report.md"]


def test_study_checkpoints_and_event_files_are_ignored_at_any_depth():
    for path in IGNORED + KEPT:
        result = _git("check-ignore", "-q", "--no-index", path)
        assert result.returncode == (0 if path in IGNORED else 1), (path, result.stderr)
    # No committed record of a study (report, metrics, evaluations) is hidden by the rules.
    hidden = _git("ls-files", "-c", "-i", "--exclude-standard", "--", "studies").stdout.decode()
    assert not hidden.split(), hidden
