"""The sentencepiece tokenizer used for preprocessing, training and export.

Default: the Llama-compatible 32,000-piece BPE shipped in the ``mistral-common`` wheel
(Apache-2.0). ``aoe-fetch-assets`` (``make assets``, part of ``make setup``) downloads it into the
assets folder with its licence and, in a checkout, also beside this module, so that a wheel built
there ships it as package data. Any sentencepiece model with the Llama id layout (unk/bos/eos =
0/1/2) works, the real Llama ``tokenizer.model`` too.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

#: Where fetched assets (the default tokenizer, corpora, downloads) live: $AOE_MEGATRON_ASSETS,
#: else ~/.cache/aoe-megatron. The Makefile and the tests point it at the checkout's assets/.
ASSETS = Path(os.environ.get("AOE_MEGATRON_ASSETS") or Path.home() / ".cache" / "aoe-megatron")
TOKENIZER_NAME = "llama32k-mistral-common.model"
#: The default tokenizer as package data (present when the package was built or set up with it).
PACKAGED_TOKENIZER = Path(__file__).resolve().parent / "tokenizer" / TOKENIZER_NAME
#: The default tokenizer as fetched into the assets folder.
DEFAULT_TOKENIZER = ASSETS / "tokenizer" / TOKENIZER_NAME


def sha256_of(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def default_tokenizer_path() -> Path:
    """The package's own copy of the default tokenizer, else the one in the assets folder."""
    for path in (PACKAGED_TOKENIZER, DEFAULT_TOKENIZER):
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the default tokenizer is missing (neither {PACKAGED_TOKENIZER} nor {DEFAULT_TOKENIZER}): "
        f"run `aoe-fetch-assets` (`make assets` in a checkout), or pass --tokenizer-model PATH")


class Tokenizer:
    """A thin sentencepiece wrapper: ids, special tokens, and the file's identity."""

    def __init__(self, model_path=None):
        import sentencepiece as spm

        self.path = Path(model_path) if model_path else default_tokenizer_path()
        if not self.path.is_file():
            raise FileNotFoundError(f"tokenizer model {self.path} does not exist")
        self.sp = spm.SentencePieceProcessor(model_file=str(self.path))
        self.vocab_size = self.sp.get_piece_size()
        self.bos_id, self.eos_id, self.unk_id = self.sp.bos_id(), self.sp.eos_id(), self.sp.unk_id()
        if self.eos_id < 0:
            raise ValueError(f"tokenizer {self.path} has no end-of-sequence token")
        self.sha256 = sha256_of(self.path)

    def encode(self, texts: list[str]) -> list[list[int]]:
        # NOTE: a plain loop in this process: parallelism comes from worker processes only
        # (sentencepiece's batch encode would start threads of its own).
        encode = self.sp.encode
        return [encode(t) for t in texts]

    def decode(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])

    def describe(self) -> dict:
        return {
            "path": str(self.path), "sha256": self.sha256, "vocab_size": self.vocab_size,
            "bos_id": self.bos_id, "eos_id": self.eos_id, "unk_id": self.unk_id,
        }
