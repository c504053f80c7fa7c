"""The study corpus holds out whole works, deterministically, with no duplicated text leaking into
validation; a data config's valid_blend feeds validation alone (old configs are unchanged)."""

from __future__ import annotations

import io
import json
import random
import tarfile
from pathlib import Path

import numpy as np
import pytest

from aoe_megatron.data.blend import build_datasets
from aoe_megatron.data.config import DataConfig
from aoe_megatron.data.study_corpus import (
    LONG, OUTPUTS, Source, _long_lines, _paragraphs, build_study_corpus, normalise, title_key,
)

_rng = random.Random(0)
VOCAB = ["".join(_rng.choice("abcdefghijklmnoprstuvwy") for _ in range(_rng.randint(3, 8)))
         for _ in range(600)]
BOILERPLATE = "This small print is shared by every text of the collection and is not a work.\n" \
              "It must never appear in the held-out validation documents of any split."
BARD = Source(name="bard", requirement="bard==1.0", licence="CC-BY-2.5 (test)",
              include=("bard/texts/*.txt",), exclude=("*/metadata.txt",),
              licence_files=("COPYING.txt",), titles_from="*/texts/metadata.txt")
MANUAL = Source(name="manual", requirement="manual==1.0", licence="MIT (test)",
                include=("docs/*.txt",), exclude=("docs/requirements.txt", "docs/_*"))
# Editions whose titles differ in spelling: only their shared lines make them one work.
RESPELT = {3: ("The Comedy of Errors", "The Comedy of Errours"), 7: ("Twelfth Night", "Twelfe-Night")}


def _paragraph(rng: random.Random, lines: int = 4) -> str:
    return "\n".join(" ".join(rng.choice(VOCAB) for _ in range(8)) for _ in range(lines))


def _text(seed, paragraphs: int) -> list[str]:
    rng = random.Random(seed)
    return [_paragraph(rng) for _ in range(paragraphs)]


def _sdist(path: Path, top: str, files: dict, reverse: bool = False) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name in sorted(files, reverse=reverse):
            data = files[name].encode()
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _bard_files() -> dict:
    files = {"COPYING.txt": "Texts CC-BY 2.5, test fixture.\n", "setup.py": "print('code')\n"}
    ini = []
    for k in range(12):
        paras = _text(f"play{k}", 15)
        folio = [p if i % 2 else " ".join(w + "e" for w in p.split(" ")) for i, p in enumerate(paras)]
        modern, old = RESPELT.get(k, (f"The Play {k}", f"Play {k}"))
        for stem, body, title in ((f"play{k}_gut", paras, modern), (f"play{k}_gut_f", folio, old)):
            files[f"bard/texts/{stem}.txt"] = "\n\n".join([BOILERPLATE, *body]) + "\n"
            ini.append(f"[{stem}]\ntitle = {title}\n")
    poems = "\n\n".join([BOILERPLATE, *_text("poems", 10)]) + "\n"
    files["bard/texts/poems.txt"] = files["bard/texts/poems_gut.txt"] = poems  # one file, twice
    ini.append("[poems_gut]\ntitle = Poetical Works\n")
    files["bard/texts/metadata.txt"] = "\n".join(ini)
    return files


def _manual_files() -> dict:
    pages = [_text(f"page{k}", 8) for k in range(40)]
    files = {"LICENSE": "MIT licence, test fixture.\n", "docs/requirements.txt": "sphinx\n",
             "docs/_theme/layout.txt": "theme, not prose\n"}
    for k, paras in enumerate(pages):
        quoted = pages[(k + 1) % 40][2]  # copied verbatim from the next page
        reflowed = "See also:\n" + pages[(k + 2) % 40][3]  # the next-but-one's lines, re-joined
        files[f"docs/page{k:02d}.txt"] = "\n\n".join([*paras, BOILERPLATE, quoted, reflowed]) + "\n"
    return files


@pytest.fixture
def sdists(tmp_path):
    return {"bard": _sdist(tmp_path / "bard-1.0.tar.gz", "bard-1.0", _bard_files()),
            "manual": _sdist(tmp_path / "manual-1.0.tar.gz", "manual-1.0", _manual_files())}


def _build(out_dir, sdists, **kw):
    logs = []
    stats = build_study_corpus(out_dir, sources=(BARD, MANUAL), sdists=sdists,
                               count_tokens=lambda text: len(text.split()) + 1,
                               valid_fraction=0.1, min_valid_tokens=2000, log=logs.append, **kw)
    return stats, logs


def _rows(out_dir, split):
    lines = (Path(out_dir) / f"study_{split}.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


def test_split_is_deterministic_and_holds_out_whole_works(tmp_path, sdists):
    stats, _ = _build(tmp_path / "a", sdists)
    shuffled = {"bard": _sdist(tmp_path / "b1.tar.gz", "bard-1.0", _bard_files(), reverse=True),
                "manual": _sdist(tmp_path / "b2.tar.gz", "manual-1.0", _manual_files(), reverse=True)}
    _build(tmp_path / "b", shuffled)
    for name in OUTPUTS[:2]:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    train, valid = _rows(tmp_path / "a", "train"), _rows(tmp_path / "a", "valid")
    for source in ("bard", "manual"):
        held = {r["meta"]["work"] for r in valid if r["meta"]["collection"] == source}
        trained = {r["meta"]["work"] for r in train if r["meta"]["collection"] == source}
        assert held and trained and not held & trained, source
        assert sorted(held) == sorted(stats["sources"][source]["valid_works"])
    # Every edition of a play is on one side, whether its titles agree or only its lines do.
    side = {Path(r["meta"]["path"]).stem: s for s, rows in (("t", train), ("v", valid)) for r in rows}
    for k in range(12):
        assert side[f"play{k}_gut"] == side[f"play{k}_gut_f"], k
    assert [["comedy of errors", "comedy of errours"], ["twelfe night", "twelfth night"]] == \
        sorted(stats["sources"]["bard"]["merged_groups"])
    assert "poems_gut" not in side and stats["sources"]["bard"]["duplicate_files"] == 1
    assert stats["sources"]["bard"]["files"] == 26 and stats["sources"]["manual"]["files"] == 40
    assert not any(r["meta"]["path"].startswith(("docs/_", "docs/req")) for r in train + valid)
    assert stats["valid"]["tokens"] >= 2000 and stats["valid"]["tokens"] < stats["train"]["tokens"]
    for split, rows in (("train", train), ("valid", valid)):
        assert stats[split]["documents"] == len(rows)
        assert stats[split]["tokens"] == sum(len(r["text"].split()) + 1 for r in rows)


def test_duplicated_paragraphs_do_not_leak_into_validation(tmp_path, sdists):
    stats, _ = _build(tmp_path, sdists)
    train, valid = _rows(tmp_path, "train"), _rows(tmp_path, "valid")
    seen = {normalise(p) for r in train for p in _paragraphs(r["text"])}
    seen_lines = set().union(*(_long_lines(r["text"]) for r in train))
    assert normalise(BOILERPLATE) in seen
    checked = 0
    for row in valid:
        for p in _paragraphs(row["text"]):
            lines = _long_lines(p)
            assert normalise(p) not in seen or len(normalise(p)) < LONG
            assert 2 * len(lines & seen_lines) < len(lines)
            checked += 1
    assert checked > 50
    # Each held-out page dropped the small print, its quotes of training pages, and its own
    # paragraphs that training pages quote.
    manual = stats["sources"]["manual"]
    pages = {int(w[-2:]) for w in manual["valid_works"]}
    quoting = sum(((k + d) % 40 not in pages) for k in pages for d in (1, 2))
    quoted = sum(((k - d) % 40 not in pages) for k in pages for d in (1, 2))
    assert quoting and quoted
    assert manual["valid_paragraphs_dropped"] == len(pages) + quoting + quoted
    # A held-out page that training quotes loses that paragraph, verbatim or re-joined.
    page_text = _manual_files()
    for k in pages:
        own = _paragraphs(page_text[f"docs/page{k:02d}.txt"])
        text = "\n\n".join(r["text"] for r in valid if r["meta"]["path"] == f"docs/page{k:02d}.txt")
        assert (own[2] in text) == ((k - 1) % 40 in pages)
        assert (own[3] in text) == ((k - 2) % 40 in pages)


def test_outputs_are_atomic_skipped_when_built_and_attributed(tmp_path, sdists):
    stats, logs = _build(tmp_path, sdists)
    assert not list(tmp_path.glob("*.partial"))
    assert json.loads((tmp_path / "study_stats.json").read_text()) == stats
    attribution = (tmp_path / "ATTRIBUTION-study").read_text()
    assert "bard==1.0" in attribution and "manual==1.0" in attribution and "MIT (test)" in attribution
    assert (tmp_path / "LICENSE-study-bard-COPYING").read_text() == "Texts CC-BY 2.5, test fixture.\n"
    assert (tmp_path / "LICENSE-study-manual-LICENSE").read_text() == "MIT licence, test fixture.\n"
    assert any("works in" in line for line in logs)
    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    again, logs = _build(tmp_path, {})  # no sdists needed: nothing is rebuilt
    assert again == stats and "already has" in logs[0]
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before
    with pytest.raises(ValueError, match="over half of the corpus"):
        build_study_corpus(tmp_path / "small", sources=(BARD, MANUAL), sdists=sdists,
                           count_tokens=len, min_valid_tokens=10**9, log=lambda _: None)


def test_title_keys():
    assert title_key("The Tragedy of King Lear") == title_key("King Lear") == "lear"
    assert title_key("Love's Labour's Lost") == "loves labours lost"
    assert title_key("King Henry IV, Part 1") == title_key("Henry IV Part 1")
    assert title_key("The Tempest") != title_key("Timon of Athens")


# --- data configs with a held-out validation blend ---------------------------------------------

MANIFEST_TOKENIZER = {"path": "fixture.model", "sha256": "5" * 64, "vocab_size": 32000,
                      "bos_id": 1, "eos_id": 2, "unk_id": 0}


def _indexed(tmp_path, name: str, low: int, docs: int = 60, sha: str = "5" * 64) -> str:
    """A dataset of ``docs`` documents with ids in [low, low + 100), each ending in EOD (2)."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / f"{name}_text_document")
    rng = np.random.default_rng(low)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for _ in range(docs):
        ids = np.append(rng.integers(low, low + 100, size=int(rng.integers(20, 80))), 2)
        builder.add_document(ids.astype(np.uint16), [len(ids)])
    builder.finalize(f"{prefix}.idx")
    manifest = {"tokenizer": {**MANIFEST_TOKENIZER, "sha256": sha},
                "policy": {"prepend_bos": False, "append_eod": True}}
    Path(f"{prefix}.manifest.json").write_text(json.dumps(manifest))
    return prefix


def _ids(dataset) -> set:
    return set(np.concatenate([np.asarray(dataset[i]["tokens"]) for i in range(len(dataset))]).tolist())


def test_valid_blend_feeds_validation_only(tmp_path):
    a, b = _indexed(tmp_path, "a", 1000), _indexed(tmp_path, "b", 3000)
    held = _indexed(tmp_path, "held", 5000)
    config = tmp_path / "data.yaml"
    config.write_text(f"blend:\n  - {{prefix: {a}, weight: 3}}\n  - {{prefix: {b}, weight: 1}}\n"
                      f"valid_blend:\n  - {{prefix: {held}, weight: 1}}\n")
    cfg = DataConfig.load(config)
    assert cfg.prefixes == (a, b, held) and cfg.split is None
    assert cfg.train_blend == ([a, b], [3.0, 1.0]) and cfg.valid_blend == ([held], [1.0])
    train, valid, test = build_datasets(str(config), seq_length=16, seed=5, num_samples=(400, 50, 7))
    assert test is None and len(train) >= 400 and len(valid) >= 50
    train_ids, valid_ids = _ids(train), _ids(valid)
    assert train_ids - {2} <= set(range(1000, 1100)) | set(range(3000, 3100))
    assert train_ids & set(range(1000, 1100)) and train_ids & set(range(3000, 3100))
    assert valid_ids - {2} <= set(range(5000, 5100)) and len(valid_ids) > 50
    _, none, _ = build_datasets(cfg, seq_length=16, seed=5, num_samples=(10, 0, 0))
    assert none is None
    # The validation set is checked against the training tokenizer too.
    other = _indexed(tmp_path, "other", 5000, sha="6" * 64)
    with pytest.raises(ValueError, match="differ in tokenizer"):
        build_datasets({"blend": [{"prefix": a}], "valid_blend": [{"prefix": other}]},
                       seq_length=16, seed=5, num_samples=(10, 10, 0))


def test_valid_blend_misuse_is_refused():
    both = {"blend": [{"prefix": "t"}], "valid_blend": [{"prefix": "v"}], "split": "98,2,0"}
    with pytest.raises(ValueError, match="'split' and 'valid_blend' exclude each other"):
        DataConfig.load(both)
    with pytest.raises(ValueError, match="non-empty 'valid_blend'"):
        DataConfig.load({"blend": [{"prefix": "t"}], "valid_blend": []})
    with pytest.raises(ValueError, match="non-empty 'blend'"):
        DataConfig.load({"valid_blend": [{"prefix": "v"}]})
    with pytest.raises(ValueError, match="valid_blend weight must be positive"):
        DataConfig.load({"blend": [{"prefix": "t"}], "valid_blend": [{"prefix": "v", "weight": 0}]})
    with pytest.raises(ValueError, match="held out from training"):
        DataConfig.load({"blend": [{"prefix": "t"}], "valid_blend": [{"prefix": "t"}]})
    with pytest.raises(ValueError, match="exclude each other"):
        DataConfig(("t", "v"), (1.0,), "98,2,0", (1.0,))
    with pytest.raises(ValueError, match="2 prefixes for 1 blend, 0 valid_blend and 0 test_blend weights"):
        DataConfig(("t", "v"), (1.0,))
    cfg = DataConfig(("/d/t", "/d/v", "/abs/w"), (1.0,), None, (1.0, 2.0))
    assert cfg.valid_blend == (["/d/v", "/abs/w"], [1.0, 2.0]) and cfg.test_blend is None
    assert cfg.to_dict() == {"blend": [{"prefix": "/d/t", "weight": 1.0}],
                             "valid_blend": [{"prefix": "/d/v", "weight": 1.0},
                                             {"prefix": "/abs/w", "weight": 2.0}]}


def _old_build_datasets(prefixes, weights, split, *, seq_length, seed, num_samples):
    """build_datasets before valid_blend existed (blend + split), for comparison."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    from aoe_megatron.data.blend import MegatronTokenizerView, check_manifests

    gpt_cfg = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=(list(prefixes), list(weights)),
        split=split, tokenizer=MegatronTokenizerView(check_manifests(prefixes)),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        path_to_cache=None, mmap_bin_files=True)
    return BlendedMegatronDatasetBuilder(GPTDataset, list(num_samples), lambda: True, gpt_cfg).build()


def test_old_style_config_gives_the_same_samples(tmp_path):
    a, b = _indexed(tmp_path, "a", 1000), _indexed(tmp_path, "b", 3000)
    raw = {"blend": [{"prefix": a, "weight": 2}, {"prefix": b, "weight": 1}], "split": "90,8,2"}
    cfg = DataConfig.load(raw)
    assert cfg == DataConfig((a, b), (2.0, 1.0), "90,8,2") and cfg.valid_blend is None
    assert DataConfig.load({"blend": [{"prefix": a}]}).split == "969,30,1"
    new = build_datasets(raw, seq_length=16, seed=9, num_samples=(120, 20, 5))
    old = _old_build_datasets((a, b), (2.0, 1.0), "90,8,2", seq_length=16, seed=9,
                              num_samples=(120, 20, 5))
    for mine, theirs in zip(new, old):
        assert len(mine) == len(theirs)
        for i in range(len(mine)):
            np.testing.assert_array_equal(mine[i]["tokens"], theirs[i]["tokens"])
            np.testing.assert_array_equal(mine[i]["labels"], theirs[i]["labels"])
