"""Adopting corpora tokenized by Megatron-LM (issue #32): a .bin/.idx written by megatron-core's
IndexedDatasetBuilder, as Megatron-LM's tools/preprocess_data.py writes it (no manifest), gets the
manifest aoe-preprocess writes, after which it verifies and the training readers accept it."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from aoe_megatron.cli import verify_data
from aoe_megatron.data import adopt as adopt_module
from aoe_megatron.data.adopt import adopt, inspect_corpus, unadopted_manifest
from aoe_megatron.data.blend import check_manifests
from aoe_megatron.data.integrity import CorpusDamaged, check_datasets, verify_dataset
from aoe_megatron.data.manifest import read_manifest
from aoe_megatron.data.tokenizer import Tokenizer
from aoe_megatron.train.datacheck import dataset_fingerprint

TEXTS = ["To be, or not to be, that is the question:",
         "Whether 'tis nobler in the mind to suffer the slings and arrows of outrageous fortune,",
         "Or to take arms against a sea of troubles, and by opposing end them.",
         "To die: to sleep; no more; and by a sleep to say we end the heart-ache."]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer()


def _documents(tok, *, eod=True, bos=False) -> list:
    """Documents as lists of sentences of ids, as Megatron-LM's preprocess_data.py makes them:
    EOD appended to a document's last sentence (--append-eod); the second document is split
    over two sentences (--split-sentences), and the last is empty (no sentence at all)."""
    ids = tok.encode(TEXTS)
    docs = [[ids[0]], [ids[1], ids[2]], [ids[3]], []]
    for doc in docs[:-1]:
        if bos:
            doc[0] = [tok.bos_id, *doc[0]]
        if eod:
            doc[-1] = [*doc[-1], tok.eos_id]
    return docs


def _write(prefix, docs, dtype=np.uint16) -> Path:
    """A megatron-core dataset: add_item per sentence, end_document per document."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    for doc in docs:
        for sentence in doc:
            builder.add_item(torch.tensor(sentence, dtype=torch.int64))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return Path(prefix)


@pytest.fixture
def megatron_corpus(tmp_path, tok):
    return _write(tmp_path / "rp_text_document", _documents(tok))


def _sha(path) -> dict:
    raw = Path(path).read_bytes()
    return {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}


def test_adopt_writes_the_manifest_of_aoe_preprocess_and_it_verifies(megatron_corpus, tok, capsys):
    prefix = megatron_corpus
    manifest = adopt(str(prefix))
    assert json.loads(Path(f"{prefix}.manifest.json").read_text()) == manifest
    docs = _documents(tok)
    assert manifest["documents"] == 4  # the empty one too: it has its document index entry
    assert manifest["tokens"] == sum(len(s) for doc in docs for s in doc)
    assert manifest["dtype"] == "uint16"
    assert manifest["policy"] == {"prepend_bos": False, "append_eod": True}
    assert manifest["tokenizer"] == tok.describe()
    assert manifest["files"] == {"bin": _sha(f"{prefix}.bin"), "idx": _sha(f"{prefix}.idx")}
    assert manifest["sources"] == [] and manifest["format"] == "aoe-megatron-preprocess"
    checks = manifest["adopted"]["checks"]
    assert manifest["adopted"]["from"] == "megatron-lm" and manifest["adopted"]["when"]
    assert checks["eod"] == {"id": tok.eos_id, "sampled": 3, "found": 3, "finding": "all sampled"}
    assert checks["bos"]["finding"] == "none" and checks["empty_documents"] == 1
    assert checks["sequences"] == 4 and checks["vocab"]["within"]
    assert verify_dataset(str(prefix), read_manifest(str(prefix))) == []
    assert "WARNING" not in capsys.readouterr().err


def test_adopting_what_aoe_preprocess_wrote_gives_its_manifest_back(corpus, tmp_path):
    """The session corpus (aoe-preprocess, --append-eod --prepend-bos) without its manifest."""
    prefix = tmp_path / "d_text_document"
    for ext in (".bin", ".idx"):
        shutil.copy(f"{corpus['prefix']}{ext}", f"{prefix}{ext}")
    ours = read_manifest(str(corpus["prefix"]))
    adopted = adopt(str(prefix))
    for key in ("version", "tokenizer", "policy", "dtype", "documents", "tokens", "files"):
        assert adopted[key] == ours[key], key


def test_the_training_readers_accept_an_adopted_corpus(megatron_corpus, tok):
    prefix = str(megatron_corpus)
    manifest = adopt(prefix)
    assert check_manifests([prefix], tok.sha256) == manifest
    check_datasets({prefix: manifest}, say=pytest.fail)  # sizes recorded: no note
    fingerprint = dataset_fingerprint(prefix)
    assert fingerprint["documents"] == 4 and fingerprint["tokens"] == manifest["tokens"]
    assert fingerprint["tokenizer_sha256"] == tok.sha256


def test_megatron_cores_gpt_dataset_reads_an_adopted_corpus(corpus, tmp_path, tok):
    from aoe_megatron.data.blend import build_datasets

    texts = [json.loads(line)["text"] for line in Path(corpus["src"]).read_text().splitlines()]
    docs = []
    for ids in tok.encode(texts):  # each document over two sequences, EOD at its end
        ids = [*ids, tok.eos_id]
        docs.append([ids[: len(ids) // 2], ids[len(ids) // 2:]])
    prefix = str(_write(tmp_path / "rp_text_document", docs))
    assert adopt(prefix)["documents"] == len(texts)
    train, valid, _ = build_datasets({"blend": [{"prefix": prefix, "weight": 1.0}],
                                      "split": "90,10,0"}, seq_length=64, seed=1,
                                     num_samples=(20, 4, 0), tokenizer_sha256=tok.sha256)
    assert len(train) >= 20 and len(valid) >= 4 and train[0]["tokens"].shape == (64,)


def test_a_corpus_without_eod_is_adopted_with_append_eod_false_and_a_warning(tmp_path, tok):
    prefix = _write(tmp_path / "noeod", _documents(tok, eod=False, bos=True))
    said = []
    manifest = adopt(str(prefix), say=said.append)
    assert manifest["policy"] == {"prepend_bos": True, "append_eod": False}
    assert len(said) == 1 and "none of the 3 sampled documents" in said[0], said
    assert "training refuses it" in said[0]


def test_some_documents_with_eod_and_others_without_are_refused(tmp_path, tok):
    docs = _documents(tok)
    docs[2][-1] = docs[2][-1][:-1]  # one document lost its EOD
    prefix = _write(tmp_path / "mixed", docs)
    with pytest.raises(ValueError, match=r"2 of 3 sampled documents end with EOD"):
        adopt(str(prefix))
    assert not Path(f"{prefix}.manifest.json").exists()


def test_token_ids_beyond_the_vocabulary_are_refused(tmp_path, tok):
    docs = _documents(tok)
    docs[0][0] = [*docs[0][0][:-1], tok.vocab_size + 5, tok.eos_id]
    prefix = _write(tmp_path / "wide", docs, dtype=np.int32)
    with pytest.raises(ValueError, match=r"outside the 32000 ids .* another tokenizer\?"):
        adopt(str(prefix))


def test_a_truncated_bin_is_refused(megatron_corpus):
    prefix = megatron_corpus
    raw = Path(f"{prefix}.bin").read_bytes()
    Path(f"{prefix}.bin").write_bytes(raw[:-4])
    with pytest.raises(CorpusDamaged, match=r"but .*\.bin has .*not one dataset"):
        adopt(str(prefix))
    with pytest.raises(CorpusDamaged, match="not one dataset"):
        unadopted_manifest(str(prefix))


def test_an_existing_manifest_is_refused_unless_overwrite(megatron_corpus):
    prefix = str(megatron_corpus)
    adopt(prefix)
    with pytest.raises(ValueError, match="manifest.json exists; pass --overwrite"):
        adopt(prefix)
    assert adopt(prefix, overwrite=True)["documents"] == 4
    assert not list(megatron_corpus.parent.glob("*.tmp-*"))


def test_sampled_documents_are_evenly_spaced_and_bounded(megatron_corpus, tok, monkeypatch):
    monkeypatch.setattr(adopt_module, "DOCUMENT_SAMPLE", 2)  # documents 0 and 3 (empty)
    monkeypatch.setattr(adopt_module, "TOKEN_SAMPLE_BYTES", 16)
    monkeypatch.setattr(adopt_module, "TOKEN_WINDOWS", 2)
    checks = inspect_corpus(str(megatron_corpus), tok)
    assert checks["eod"]["sampled"] == 1 and checks["empty_documents"] == 1
    assert checks["vocab"]["sampled_tokens"] == 8 + 2  # two windows of 4 tokens, head and tail
    assert checks["tokens"] == sum(len(s) for doc in _documents(tok) for s in doc)


def test_unadopted_manifest_is_adopts_without_hashes(megatron_corpus):
    prefix = str(megatron_corpus)
    held = unadopted_manifest(prefix)
    assert not Path(f"{prefix}.manifest.json").exists()
    written = adopt(prefix)
    assert held["adopted"] == {"from": "megatron-lm", "unadopted": True}
    assert held["files"] == {k: {"size": v["size"]} for k, v in written["files"].items()}
    strip = ("adopted", "files")
    assert {k: v for k, v in held.items() if k not in strip} == \
           {k: v for k, v in written.items() if k not in strip}
    check_datasets({prefix: held}, say=pytest.fail)


def test_the_cli_adopts_then_verifies(megatron_corpus, tmp_path, tok, capsys):
    prefix = megatron_corpus
    assert verify_data.main([str(prefix)]) == 2
    assert "aoe-verify-data --adopt" in capsys.readouterr().err
    assert verify_data.main(["--adopt", f"{prefix}.bin", "--tokenizer-model", str(tok.path)]) == 0
    out = capsys.readouterr().out
    assert f"{prefix}: adopted: 4 documents, " in out and "uint16" in out, out
    assert "EOD at the end: all sampled (3 of 3 sampled documents, id 2); append_eod True" in out
    assert "1 of 1 dataset(s) adopted" in out
    assert verify_data.main([f"{prefix}.idx"]) == 0
    assert f"{prefix}: ok" in capsys.readouterr().out
    assert verify_data.main(["--adopt", str(prefix)]) == 1  # already adopted
    assert "REFUSED" in capsys.readouterr().out and verify_data.main(
        ["--adopt", str(prefix), "--overwrite"]) == 0
    capsys.readouterr()
    assert verify_data.main(["--adopt", str(tmp_path / "nothing")]) == 1
    assert "nothing.bin is missing" in capsys.readouterr().out
    assert verify_data.main(["--adopt", str(prefix), "--tokenizer-model",
                             str(tmp_path / "no.model")]) == 2
    assert verify_data.main([str(prefix), "--overwrite"]) == 2
