"""aoe-preprocess: lossless, counted rejections, identical across formats and workers,
atomic, and readable by megatron-core's IndexedDataset and GPTDataset."""

from __future__ import annotations

import gzip
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from aoe_megatron.data.assets import CORPUS
from aoe_megatron.data.preprocess import PreprocessConfig, PreprocessError, preprocess
from aoe_megatron.data.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
EXTRA = ["Unicode: héllo wörld, ﬁ ligature, 日本語, emoji 🎉 and tabs\tand  double  spaces.",
         "Numbers 1234567 and code:\n    def f(x):\n        return x ** 2\n"]


@pytest.fixture(scope="module")
def docs():
    if not CORPUS.is_file():
        pytest.fail(f"{CORPUS} is missing: run `make assets` (part of `make setup`)")
    with open(CORPUS, encoding="utf-8") as fh:
        rows = [json.loads(next(fh)) for _ in range(30)]
    return [r["text"] for r in rows] + EXTRA


def write_jsonl(path: Path, texts, opener=open):
    with opener(path, "wt", encoding="utf-8") as fh:
        for i, t in enumerate(texts):
            fh.write(json.dumps({"text": t, "meta": {"i": i}}) + "\n")
    return path


def run(tmp_path, inputs, name="out", **kw):
    cfg = PreprocessConfig(inputs=tuple(map(str, inputs)), output_prefix=str(tmp_path / name),
                           append_eod=kw.pop("append_eod", True), log_interval=1e9, **kw)
    return next(iter(preprocess(cfg).values())), str(tmp_path / name) + "_text_document"


def read_docs(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    # NOTE: copy: the arrays are views of a memory map that closes with the dataset.
    return [np.array(ds[i]) for i in range(len(ds))]


def test_documents_decode_to_their_text_with_eod_policy(tmp_path, docs):
    src = write_jsonl(tmp_path / "in.jsonl", docs)
    manifest, prefix = run(tmp_path, [src], workers=0)
    tok = Tokenizer()
    stored = read_docs(prefix)
    assert len(stored) == len(docs) == manifest["documents"]
    for ids, text in zip(stored, docs):
        assert ids[-1] == tok.eos_id and tok.bos_id not in ids[:-1].tolist()
        assert tok.decode(ids[:-1]) == text
    assert manifest["tokens"] == sum(len(s) for s in stored)
    assert manifest["policy"] == {"prepend_bos": False, "append_eod": True}
    assert manifest["tokenizer"]["sha256"] == tok.sha256
    assert manifest["sources"][0]["sha256"] == __import__("hashlib").sha256(src.read_bytes()).hexdigest()
    assert manifest["sources"][0]["size"] == src.stat().st_size
    bos, _ = run(tmp_path, [src], name="bos", workers=0, append_eod=False, prepend_bos=True)
    for ids, text in zip(read_docs(str(tmp_path / "bos_text_document")), docs):
        assert ids[0] == tok.bos_id and tok.eos_id not in ids.tolist()
        assert tok.decode(ids[1:]) == text


def test_gpt_dataset_reads_the_output(tmp_path, docs):
    from aoe_megatron.data.blend import build_datasets

    src = write_jsonl(tmp_path / "in.jsonl", docs)
    _, prefix = run(tmp_path, [src], workers=0)
    train, valid, test = build_datasets(
        {"blend": [{"prefix": prefix, "weight": 1.0}], "split": "90,10,0"},
        seq_length=64, seed=1, num_samples=(20, 4, 0),
    )
    assert test is None and len(train) >= 20 and len(valid) >= 4
    sample = train[0]
    assert sample["tokens"].shape == (64,) and sample["labels"].shape == (64,)
    assert (sample["tokens"][1:] == sample["labels"][:-1]).all()


BAD_LINES = [
    (b'{"text": "a good one", "meta": {}}', None),
    (b'{"text": "broken json', "invalid_json"),
    (b'["a", "list"]', "invalid_json"),
    (b'{"text": "bad \xff\xfe bytes"}', "invalid_utf8"),
    (b'{"text": "lone \\ud800 surrogate"}', "invalid_utf8"),
    (b'{"meta": {"no": "text"}}', "missing_field"),
    (b'{"text": 42}', "non_string_field"),
    (b'{"text": null}', "non_string_field"),
    (b'{"text": ""}', "empty_text"),
    (b'{"text": "   \\n\\t "}', "empty_text"),
    (b"", None),  # blank line: skipped, not rejected
    (b'{"text": "another good one", "pred_label": "__label__cc"}', None),
]


def test_bad_records_are_counted_and_good_ones_kept(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_bytes(b"\n".join(line for line, _ in BAD_LINES) + b"\n")
    manifest, prefix = run(tmp_path, [src], workers=2)
    expected = {}
    for line, reason in BAD_LINES:
        if reason:
            expected[reason] = expected.get(reason, 0) + 1
    assert {r: n for r, n in manifest["rejected"].items() if n} == expected
    assert manifest["documents"] == 2 and manifest["blank_lines"] == 1
    assert manifest["rejected_examples"]["missing_field"] == [f"{src}:6"]
    tok = Tokenizer()
    assert [tok.decode(d[:-1]) for d in read_docs(prefix)] == ["a good one", "another good one"]
    with pytest.raises(PreprocessError, match="--strict: 9 record"):
        run(tmp_path, [src], name="strict", workers=0, strict=True)
    assert not list(tmp_path.glob("strict*"))
    empty = tmp_path / "nothing.jsonl"
    empty.write_bytes(BAD_LINES[1][0] + b"\n")
    with pytest.raises(PreprocessError, match="no valid document"):
        run(tmp_path, [empty], name="none", workers=0)


def test_truncated_gzip_and_zstd_are_counted(tmp_path, docs):
    import zstandard

    payload = b"".join(json.dumps({"text": t}).encode() + b"\n" for t in docs)
    for suffix, blob in ((".gz", gzip.compress(payload)),
                         (".zst", zstandard.ZstdCompressor().compress(payload))):
        src = tmp_path / f"cut.jsonl{suffix}"
        src.write_bytes(blob[: len(blob) * 2 // 3])
        manifest, _ = run(tmp_path, [src, write_jsonl(tmp_path / "ok.jsonl", ["after"])],
                          name=f"cut{suffix[1:]}", workers=0)
        assert manifest["rejected"]["truncated_stream"] == 1
        assert 0 < manifest["documents"] < len(docs) + 1  # recovered lines + the next file
        assert manifest["sources"][1]["path"].endswith("ok.jsonl")


def test_formats_and_worker_counts_give_identical_output(tmp_path, docs):
    import zstandard

    plain = write_jsonl(tmp_path / "in.jsonl", docs)
    gz = write_jsonl(tmp_path / "in.jsonl.gz", docs, opener=gzip.open)
    zst = tmp_path / "in.jsonl.zst"
    zst.write_bytes(zstandard.ZstdCompressor().compress(plain.read_bytes()))
    outputs = {}
    for name, src, workers in (("plain1", plain, 1), ("plain2", plain, 2), ("gz", gz, 2),
                               ("zst", zst, 1), ("inproc", plain, 0)):
        _, prefix = run(tmp_path, [src], name=name, workers=workers, chunk_bytes=4096)
        outputs[name] = (Path(prefix + ".bin").read_bytes(), Path(prefix + ".idx").read_bytes())
    assert all(v == outputs["plain1"] for v in outputs.values())
    m1 = Path(tmp_path / "plain1_text_document.manifest.json").read_text()
    m2 = Path(tmp_path / "plain2_text_document.manifest.json").read_text()
    assert m1.replace("plain1", "X") == m2.replace("plain2", "X")


def test_per_input_outputs_and_refusal_to_overwrite(tmp_path, docs):
    a = write_jsonl(tmp_path / "a.jsonl", docs[:5])
    b = write_jsonl(tmp_path / "b.jsonl", docs[5:8])
    cfg = PreprocessConfig(inputs=(f"first={a}", f"second={tmp_path}/b*.jsonl"),
                           output_prefix=str(tmp_path / "rp"), per_input=True, append_eod=True,
                           workers=0, log_interval=1e9)
    results = preprocess(cfg)
    assert sorted(Path(p).name for p in results) == ["rp_first_text_document", "rp_second_text_document"]
    assert [m["documents"] for m in results.values()] == [5, 3]
    with pytest.raises(PreprocessError, match="exists; pass --overwrite"):
        preprocess(cfg)
    with pytest.raises(PreprocessError, match="matches no file"):
        run(tmp_path, [tmp_path / "missing*.jsonl"])


def test_a_folder_input_is_its_jsonl_files(tmp_path, docs):
    """--input FOLDER: its .jsonl, .jsonl.gz and .jsonl.zst files in name order, not other files
    nor subfolders; the folder names the subset; a folder without such files is refused."""
    import zstandard

    folder = tmp_path / "shards"
    (folder / "deeper").mkdir(parents=True)
    write_jsonl(folder / "b.jsonl.gz", docs[2:5], opener=gzip.open)
    write_jsonl(folder / "a.jsonl", docs[:2])
    (folder / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(
        write_jsonl(tmp_path / "c.jsonl", docs[5:6]).read_bytes()))
    write_jsonl(folder / "deeper" / "d.jsonl", docs[6:9])
    (folder / "notes.txt").write_text("not a corpus\n")
    cfg = PreprocessConfig(inputs=(str(folder),), output_prefix=str(tmp_path / "rp"),
                           per_input=True, append_eod=True, workers=0, log_interval=1e9)
    [(prefix, manifest)] = preprocess(cfg).items()
    assert Path(prefix).name == "rp_shards_text_document"
    assert [Path(s["path"]).name for s in manifest["sources"]] == [
        "a.jsonl", "b.jsonl.gz", "c.jsonl.zst"]
    tok = Tokenizer()
    assert [tok.decode(d[:-1]) for d in read_docs(prefix)] == docs[:6]
    empty = tmp_path / "empty"
    (empty / "deeper").mkdir(parents=True)
    (empty / "deeper" / "d.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(PreprocessError, match=re.escape(
            f"input folder '{empty}' holds no .jsonl, .jsonl.gz, .jsonl.zst file")):
        run(tmp_path, [empty])


def test_interrupted_run_leaves_nothing_readable(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    big = tmp_path / "big.jsonl"
    with open(big, "wb") as out:
        data = CORPUS.read_bytes()
        for _ in range(3):
            out.write(data)
    prefix = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-m", "aoe_megatron.cli.preprocess", "--input", str(big),
         "--output-prefix", str(prefix), "--append-eod", "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT,
    )
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("killed*.partial-*")) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.2)
    time.sleep(1.0)
    assert proc.poll() is None, "finished before it could be interrupted"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    final = tmp_path / "killed_text_document"
    assert not Path(f"{final}.bin").exists() and not Path(f"{final}.idx").exists()
    assert not Path(f"{final}.manifest.json").exists()
    with pytest.raises(Exception):
        IndexedDataset(str(final))
    # The next run removes what the killed one left, and completes.
    small = tmp_path / "small.jsonl"
    small.write_text('{"text": "x"}\n')
    run(tmp_path, [small], name="killed", workers=0)
    assert not list(tmp_path.glob("killed*.partial-*"))


def test_cli_reports_errors_cleanly(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "aoe_megatron.cli.preprocess", "--input",
         str(tmp_path / "nope.jsonl"), "--output-prefix", str(tmp_path / "x")],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert out.returncode == 1 and "matches no file" in out.stderr and "Traceback" not in out.stderr


def test_several_json_keys_give_aligned_outputs(tmp_path):
    src = tmp_path / "two.jsonl"
    rows = [{"text": "body one", "title": "first"}, {"text": "body two", "title": "second"},
            {"text": "no title here"}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = PreprocessConfig(inputs=(str(src),), output_prefix=str(tmp_path / "k"),
                           json_keys=("text", "title"), append_eod=True, workers=0, log_interval=1e9)
    results = preprocess(cfg)
    tok = Tokenizer()
    by_key = {m["json_key"]: (p, m) for p, m in results.items()}
    assert set(by_key) == {"text", "title"}
    for key, expected in (("text", ["body one", "body two"]), ("title", ["first", "second"])):
        prefix, manifest = by_key[key]
        assert [tok.decode(d[:-1]) for d in read_docs(prefix)] == expected
        assert manifest["documents"] == 2 and manifest["rejected"]["missing_field"] == 1
