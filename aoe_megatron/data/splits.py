"""Which documents each split holds, checked before any process group starts.

megatron-core splits every dataset of a blend by *documents*: with split ``a,b,c`` over N
documents, split i holds documents ``round(lo_i N)`` to ``round(hi_i N)`` (its split matrix).
A split that is read but holds no documents makes ``GPTDataset._get_num_epochs`` loop forever
(it adds epochs of 0 tokens until it has the tokens asked for). So a split training reads must
hold documents, and at least one sample's tokens; the others are not built at all
(``build_datasets``). Costs: the ``.idx`` headers, plus the lengths of at most one sample's worth
of documents per split (each document has at least its EOD token).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from aoe_megatron.data.integrity import read_idx_header

SPLITS = ("train", "validation", "test")


class EmptySplit(ValueError):
    """A split training reads holds no documents, or fewer tokens than one sample."""


def split_matrix(split: str) -> list:
    """megatron-core's split matrix of ``"a,b,c"``: (lo, hi) shares per split, None if empty."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    return convert_split_vector_to_split_matrix(parse_and_normalize_split(split))


def document_ranges(documents: int, matrix: Sequence) -> list:
    """(first, end) document of each split, as megatron-core rounds them (None: not built)."""
    return [None if bounds is None else
            (int(round(bounds[0] * float(documents))), int(round(bounds[1] * float(documents))))
            for bounds in matrix]


class Lengths:
    """Token counts of a dataset's documents, read from its ``.idx`` (memory-mapped)."""

    def __init__(self, prefix: str):
        header = read_idx_header(prefix)
        self.documents = header.boundaries - 1
        idx = np.memmap(f"{prefix}.idx", dtype=np.uint8, mode="r")
        self._seq = idx[header.lengths_offset:header.pointers_offset].view(np.int32)
        self._bounds = idx[header.boundaries_offset:
                           header.boundaries_offset + 8 * header.boundaries].view(np.int64)

    def tokens(self, first: int, end: int) -> int:
        """Tokens of documents ``first`` to ``end`` (exclusive)."""
        if end <= first:
            return 0
        return int(self._seq[self._bounds[first]:self._bounds[end]].sum(dtype=np.int64))


def _suggest(lengths: Lengths, need: int) -> Optional[str]:
    """A split ``train,valid,0`` in document counts that gives both splits ``need`` tokens."""
    n = lengths.documents
    for k in range(1, min(n - 1, need) + 1):
        if lengths.tokens(n - k, n) >= need:
            return f"{n - k},{k},0" if lengths.tokens(0, n - k) >= need else None
    return None


def check_splits(per_split: Sequence, *, split: Optional[str], sample_tokens: int) -> None:
    """Refuse a split that is read but cannot give a sample (``EmptySplit``, before anything
    is built).

    ``per_split``: for train, validation and test, the prefixes read from it (empty: not read).
    ``split``: the ``a,b,c`` string applied to every prefix; None when each split has its own
    datasets (``valid_blend``), read whole."""
    matrix = split_matrix(split) if split is not None else [(0.0, 1.0)] * 3
    for i, prefixes in enumerate(per_split):
        for prefix in prefixes:
            lengths = Lengths(prefix)
            ranges = document_ranges(lengths.documents, matrix)
            first, end = ranges[i] or (0, 0)
            docs = end - first
            if docs and (docs >= sample_tokens or lengths.tokens(first, end) >= sample_tokens):
                continue
            _refuse(prefix, i, lengths, ranges, split, sample_tokens)


def _refuse(prefix: str, i: int, lengths: Lengths, ranges: list, split: Optional[str],
            sample_tokens: int) -> None:
    name, n = SPLITS[i], lengths.documents
    counts = ", ".join(f"{s} {0 if r is None else r[1] - r[0]}" for s, r in zip(SPLITS, ranges))
    first, end = ranges[i] or (0, 0)
    what = ("no documents" if end == first else
            f"{end - first} document(s) of {lengths.tokens(first, end)} tokens, fewer than one "
            f"sample ({sample_tokens} tokens: --seq-length + 1)")
    where = (f"split {split} over its {n} documents gives {counts}" if split is not None else
             f"it holds {n} document(s)")
    why = ("training reads it" if i == 0 else
           "validation reads it every --eval-interval steps; --eval-interval 0 trains without "
           "validation")
    fix = ""
    if split is not None:
        suggestion = _suggest(lengths, sample_tokens)
        fix = (f" A split that works for this dataset: \"{suggestion}\" (--split, or split: in "
               f"a data config; shares are in documents here)." if suggestion else
               " The dataset is too small to split: give a separate validation set "
               "(--valid-data-path, or valid_blend: in a data config).")
    raise EmptySplit(f"the {name} split of {prefix} holds {what}: {where}. It cannot be "
                     f"built ({why}).{fix}")
