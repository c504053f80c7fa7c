"""The tokenizer trainer's Llama id layout; blends draw in proportion; manifests must agree."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from aoe_megatron.data.assets import CORPUS
from aoe_megatron.data.blend import build_datasets, check_manifests
from aoe_megatron.data.config import DataConfig
from aoe_megatron.data.preprocess import PreprocessConfig, preprocess

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def corpus_lines():
    if not CORPUS.is_file():
        pytest.fail(f"{CORPUS} is missing: run `make assets` (part of `make setup`)")
    return CORPUS.read_text(encoding="utf-8").splitlines()


def test_trained_tokenizer_has_the_llama_id_layout(tmp_path, corpus_lines):
    import sentencepiece as spm

    src = tmp_path / "small.jsonl"
    src.write_text("\n".join(corpus_lines[:60]) + "\n", encoding="utf-8")
    out = subprocess.run(
        [sys.executable, "-m", "aoe_megatron.cli.train_tokenizer", "--input", str(src),
         "--output-prefix", str(tmp_path / "tok"), "--vocab-size", "600"],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "tok.model"))
    assert sp.get_piece_size() == 600
    assert (sp.unk_id(), sp.bos_id(), sp.eos_id(), sp.pad_id()) == (0, 1, 2, -1)
    assert [sp.id_to_piece(i) for i in range(3)] == ["<unk>", "<s>", "</s>"]
    assert [sp.id_to_piece(3 + b) for b in range(256)] == [f"<0x{b:02X}>" for b in range(256)]
    assert sp.encode("2024", out_type=str) == ["▁", "2", "0", "2", "4"]  # split digits
    text = "Ünïcødé  double  spaces\tand tabs — 日本"
    assert sp.decode(sp.encode(text)) == text  # identity normalisation + byte fallback


def test_the_same_corpus_trains_the_same_bytes(tmp_path, corpus_lines):
    """The model file names its inputs as given, not the temporary file they were read through,
    nor the thread count; the lines sampled beyond input_sentence_size are seeded: one sha256."""
    from sentencepiece import sentencepiece_model_pb2

    from aoe_megatron.data.tokenizer import sha256_of
    from aoe_megatron.data.train_tokenizer import train_tokenizer

    src = tmp_path / "small.jsonl"
    src.write_text("\n".join(corpus_lines[:400]) + "\n", encoding="utf-8")
    prefix = str(tmp_path / "tok")
    shas = []
    for threads in (1, 2):  # trained again at the same prefix: the first file is overwritten
        model = train_tokenizer([str(src)], prefix, vocab_size=400, num_threads=threads,
                                input_sentence_size=200)  # of the 400+ lines
        shas.append(sha256_of(model))
    assert shas[0] == shas[1]
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model.read_bytes())
    assert list(proto.trainer_spec.input) == [str(src)]
    assert not proto.trainer_spec.HasField("num_threads")


def _prefix(tmp_path, name, lines, tokenizer=None):
    src = tmp_path / f"{name}.jsonl"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    cfg = PreprocessConfig(inputs=(str(src),), output_prefix=str(tmp_path / name), append_eod=True,
                           workers=0, log_interval=1e9, tokenizer_model=tokenizer)
    return next(iter(preprocess(cfg)))


@pytest.mark.legs
def test_blend_draws_in_configured_proportions(tmp_path, corpus_lines):
    a = _prefix(tmp_path, "a", corpus_lines[:40])
    b = _prefix(tmp_path, "b", corpus_lines[40:80])
    config = tmp_path / "blend.yaml"
    config.write_text(f"blend:\n  - {{prefix: {a}, weight: 3}}\n  - {{prefix: {b}, weight: 1}}\n"
                      f"split: '100,0,0'\n")
    train, valid, test = build_datasets(str(config), seq_length=32, seed=3,
                                        num_samples=(4000, 0, 0))
    assert valid is None and test is None
    share_a = float(np.mean(np.asarray(train.dataset_index) == 0))
    assert share_a == pytest.approx(0.75, abs=0.01)
    assert len(train) >= 4000 and train[0]["tokens"].shape == (32,)


@pytest.mark.legs
def test_data_config_validation_and_manifest_agreement(tmp_path, corpus_lines):
    with pytest.raises(ValueError, match="non-empty 'blend'"):
        DataConfig.load({"blend": []})
    with pytest.raises(ValueError, match="must be positive"):
        DataConfig.load({"blend": [{"prefix": "x", "weight": 0}]})
    with pytest.raises(ValueError, match=r"no dataset /d/x: tried /d/x.bin/.idx; the folder /d "
                                         r"does not exist"):
        DataConfig.load({"data_root": "/d", "blend": [{"prefix": "x", "weight": 2}]})
    # the shipped configs parse; a prefix not preprocessed here is named with the paths tried
    # (the working directory, then the config's folder)
    for path in sorted((ROOT / "run").glob("data-*.yaml")):
        try:
            assert DataConfig.load(path).prefixes
        except ValueError as err:
            relative = str(path.read_text()).count("prefix: data/")
            where = (rf"tried {Path.cwd()}/data/\S+, {path.parent}/data/" if relative else
                     "no dataset /")
            assert re.search(where, str(err)), err
    with pytest.raises(FileNotFoundError, match="manifest.json is missing"):
        check_manifests([str(tmp_path / "nothing")])
    # A dataset tokenized with another tokenizer cannot join the blend.
    from aoe_megatron.data.train_tokenizer import train_tokenizer

    src = tmp_path / "t.jsonl"
    src.write_text("\n".join(corpus_lines[:30]) + "\n", encoding="utf-8")
    other = train_tokenizer([str(src)], str(tmp_path / "other"), vocab_size=400)
    a = _prefix(tmp_path, "a", corpus_lines[:10])
    b = _prefix(tmp_path, "b", corpus_lines[10:20], tokenizer=str(other))
    with pytest.raises(ValueError, match="differ in tokenizer"):
        check_manifests([a, b])
    with pytest.raises(ValueError, match="not the tokenizer given"):
        check_manifests([a], tokenizer_sha256="0" * 64)
    cfg = DataConfig.load({"data_root": str(tmp_path), "blend": [{"prefix": "a_text_document",
                                                                  "weight": 2}]})
    assert cfg.prefixes == (a,) and cfg.weights == (2.0,)
    manifest = json.loads(Path(f"{b}.manifest.json").read_text())
    assert manifest["tokenizer"]["vocab_size"] == 400 and manifest["dtype"] == "uint16"
