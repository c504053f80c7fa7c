"""Shared fixtures: one gloo process group (world size 1) with megatron-core's parallel state, a
tokenized corpus and tiny trained checkpoints."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import yaml

# torch's threads per test process, the xdist workers' too: 2 each on `make test`'s two workers
# oversubscribe the cores, yet that first pass ran faster than with 1 thread per worker and the
# slow tests first (409 s against 489 and 497 s: docs/testing.md).
os.environ.setdefault("OMP_NUM_THREADS", "2")
ROOT = Path(__file__).resolve().parents[1]
# The checkout's fetched assets (`make assets`): set before any aoe_megatron module reads it.
os.environ.setdefault("AOE_MEGATRON_ASSETS", str(ROOT / "assets"))
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")

CORPUS = ROOT / "assets" / "corpus" / "shakespeare.jsonl"


# Markers (slow, distributed, slurm, gpu) are registered in pyproject.toml; select with ``-m``.


@pytest.fixture(scope="session")
def megatron_world():
    """torch.distributed + megatron parallel state, TP = PP = EP = 1, in this process."""
    from aoe_megatron.runtime.distributed import init_megatron

    init_megatron(rank=0, world_size=1, expert_parallel_size=1)
    yield


@pytest.fixture
def seeded(megatron_world):
    import torch

    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """60 documents of the demo corpus, tokenized with BOS prepended (the policy export must
    carry): {"root", "data" (a data config, split 90/10/0), "src" (the JSONL), "prefix"}.
    Shared by the session: read it, do not write into it."""
    from aoe_megatron.data.preprocess import PreprocessConfig, preprocess

    root = tmp_path_factory.mktemp("corpus")
    src = root / "docs.jsonl"
    with open(CORPUS) as fh:
        src.write_text("".join(next(fh) for _ in range(60)))
    preprocess(PreprocessConfig(inputs=(str(src),), output_prefix=str(root / "d"), append_eod=True,
                                prepend_bos=True, workers=0, log_interval=1e9))
    data = root / "data.yaml"
    data.write_text(f"blend:\n  - {{prefix: {root / 'd_text_document'}, weight: 1}}\nsplit: '90,10,0'\n")
    return {"root": root, "data": data, "src": src, "prefix": root / "d_text_document"}


@pytest.fixture(scope="session")
def trained_checkpoint(corpus, tmp_path_factory):
    """``trained_checkpoint(arch)``: the step folder of a tiny model of ``arch`` trained 3 steps on
    ``corpus`` at EP=2 over two processes (ZeRO-1); each arch is trained once per session. A test
    that uses it starts processes: mark it ``distributed`` and ``slow``.

    The data index cache: the aoe run builds its own (default: ``data-cache`` beside the run
    directory); the moe run's is built ahead by ``--build-data-index-only --world-size 2`` into
    ``prebuilt/``, which training then reads. ``trained_checkpoint.runs[arch]``: {"out", "output",
    and for moe "build_output", "built" and "after" (index files: mtimes after the build and
    after training)}."""
    from aoe_megatron.data.index_cache import index_files
    from aoe_megatron.runtime import launch

    trained: dict = {}

    def get(arch: str) -> Path:
        if arch not in trained:
            out = tmp_path_factory.mktemp(f"train_{arch}")
            args = ["--preset", "tiny", "--arch", arch, "--data-path", corpus["data"],
                    "--expert-model-parallel-size", "2", "--train-iters", "3",
                    "--global-batch-size", "4", "--micro-batch-size", "1", "--lr-warmup-iters", "1",
                    "--eval-interval", "100", "--zero-stage", "1"]
            record = get.runs[arch] = {"out": out}
            if arch == "moe":
                args += ["--data-cache-path", out / "prebuilt"]
                build = launch.run([*args, "--build-data-index-only", "--world-size", "2"],
                                   nproc=1, cwd=ROOT, timeout=300)
                assert build.returncode == 0, build.output[-6000:]
                record.update(build_output=build.output, built=index_files(out / "prebuilt"))
            run = launch.run([*args, "--ckpt-dir", out / "ckpt", "--run-dir", out / "run"],
                             nproc=2, cwd=ROOT, timeout=900)
            assert run.returncode == 0, run.output[-6000:]
            record["output"] = run.output
            if arch == "moe":
                record["after"] = index_files(out / "prebuilt")
            trained[arch] = out / "ckpt" / "step_00000003"
        return trained[arch]

    get.runs = {}
    return get


@pytest.fixture(scope="session")
def tiny_reference_run(tmp_path_factory):
    """The tiny run (``tests.helpers.TINY_RUN``, world 2 / EP 2, --mock-data) for 8 steps with a
    checkpoint every 2, run once per session: the uninterrupted run that the resume, kill and
    integrity tests compare against. {"args", "losses", "summary", "ckpt", "run", "output"}. Read it, do not
    write into it: copy ``ckpt`` first (``shutil.copytree``)."""
    from aoe_megatron.runtime import launch
    from tests.helpers import TINY_RUN_ARGS

    tmp = tmp_path_factory.mktemp("tiny_reference")
    args = [*TINY_RUN_ARGS, "--train-iters", "8", "--save-interval", "2"]
    run = launch.run([*args, "--ckpt-dir", tmp / "ck", "--run-dir", tmp / "run"], nproc=2,
                     cwd=ROOT, timeout=600, summary=tmp / "summary.json")
    assert run.returncode == 0, run.output[-6000:]
    summary = run.summary()
    assert sorted(summary["losses"]) == list(range(1, 9)), summary["losses"]
    return {"args": args, "losses": summary["losses"], "summary": summary, "ckpt": tmp / "ck",
            "run": tmp / "run", "output": run.output}


@pytest.fixture(scope="session")
def study_data(tmp_path_factory):
    """The study tests' corpus: two indexed datasets (train, held-out valid) from a small
    tokenizer, and a data config."""
    from aoe_megatron.data.preprocess import PreprocessConfig, preprocess
    from aoe_megatron.data.train_tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("study_data")
    words = "the king said unto his people that the river runs cold and the night is long".split()
    for split, n in (("train", 160), ("valid", 30)):
        src = root / f"{split}.jsonl"
        with open(src, "w") as out:
            for i in range(n):
                text = " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(120))
                out.write(json.dumps({"text": f"{split} {i}: {text}"}) + "\n")
    tok = train_tokenizer([str(root / "train.jsonl")], str(root / "tok"), vocab_size=300)
    for split in ("train", "valid"):
        preprocess(PreprocessConfig(inputs=(str(root / f"{split}.jsonl"),),
                                    output_prefix=str(root / split), append_eod=True, workers=0,
                                    log_interval=1e9, tokenizer_model=str(tok)))
    data = root / "data.yaml"
    data.write_text(yaml.safe_dump({"blend": [{"prefix": str(root / "train_text_document"), "weight": 1.0}],
                                    "valid_blend": [{"prefix": str(root / "valid_text_document"), "weight": 1.0}]}))
    return data


# ---- CPU-seconds per test (self + every waited-for child process), beside pytest's wall times ----
# This VM has steal time, so wall time alone says little about what a test costs; a test whose CPU
# is far under its wall time waits (a timeout, a signal, Slurm). `make test` prints the table;
# AOE_TEST_TIMES=<file> also adds every test's {nodeid: [wall_s, cpu_s]} to that JSON file (each
# pytest session of `make test` its own tests: delete the file first for one run's).

def _cpu_seconds() -> float:
    import resource

    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


_STARTED: dict = {}
_TIMES: dict = {}


def pytest_runtest_setup(item):
    import time

    _STARTED[item.nodeid] = (time.monotonic(), _cpu_seconds())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    import time

    report = (yield).get_result()
    start = _STARTED.get(item.nodeid)
    if call.when == "teardown" and start is not None:
        report.user_properties.append(
            ("wall_cpu_s", (time.monotonic() - start[0], _cpu_seconds() - start[1])))


def pytest_runtest_logreport(report):
    for key, value in getattr(report, "user_properties", ()):
        if key == "wall_cpu_s":
            _TIMES[report.nodeid] = [round(float(v), 2) for v in value]


def _merge_times(path: Path) -> None:
    """Add this session's times to ``path``: `make test` runs three pytest sessions, two of them at
    once (the Makefile), so each reads, updates and rewrites the file under a lock."""
    import fcntl

    with open(path, "a+", encoding="utf-8") as fh:  # (appends land at the end: after truncate, 0)
        fcntl.flock(fh, fcntl.LOCK_EX)
        fh.seek(0)
        text = fh.read()
        times = {**(json.loads(text) if text.strip() else {}), **_TIMES}
        fh.truncate(0)
        fh.write(json.dumps(times, indent=1, sort_keys=True) + "\n")


def pytest_terminal_summary(terminalreporter):
    if not _TIMES:
        return
    path = os.environ.get("AOE_TEST_TIMES")
    if path:
        _merge_times(Path(path))
    wall = sum(w for w, _ in _TIMES.values())
    cpu = sum(c for _, c in _TIMES.values())
    terminalreporter.section("wall and CPU seconds (this process and its children)")
    terminalreporter.write_line(f"{len(_TIMES)} tests: {wall:.0f} s wall, {cpu:.0f} CPU-s in all; "
                                "the 15 longest by wall:")
    for nodeid, (w, c) in sorted(_TIMES.items(), key=lambda kv: -kv[1][0])[:15]:
        terminalreporter.write_line(f"{w:8.1f} s {c:8.1f} CPU-s  {nodeid}")
