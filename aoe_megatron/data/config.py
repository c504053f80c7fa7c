"""Data configs: the blend of dataset prefixes a run reads, from YAML or Megatron-LM's flags.

    blend:
      - {prefix: data/redpajama_common_crawl_text_document, weight: 67.0}
      - {prefix: data/redpajama_c4_text_document, weight: 15.0}
    split: "969,30,1"          # train, valid, test shares of every prefix (of its documents)
    data_root: /datasets       # optional; relative prefixes are joined to it

or, with a held-out validation set (no split: ``blend`` is all training, ``valid_blend`` all
validation; ``test_blend`` likewise, optional):

    blend:
      - {prefix: data/study_train_text_document, weight: 1.0}
    valid_blend:
      - {prefix: data/study_valid_text_document, weight: 1.0}

A relative prefix resolves against the working directory, then against the config's own folder
(``data/paths.py``); Megatron-LM's command-line forms build the same ``DataConfig``
(``DataConfig.from_args``). Every prefix must have a preprocessing manifest (``aoe-preprocess``,
or ``aoe-verify-data --adopt`` for a Megatron-LM corpus), all with one tokenizer (and the
tokenizer given to training, when one is): a run never mixes tokenizers silently.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence

from aoe_megatron.data.paths import (
    DataPathError,
    find_config,
    is_config,
    resolve_prefix,
    sizes_as_weights,
    weighted_list,
)

#: Megatron-LM's default --split.
DEFAULT_SPLIT = "969,30,1"
ROLES = ("blend", "valid_blend", "test_blend")


@dataclass(frozen=True)
class DataConfig:
    prefixes: tuple
    """Every dataset the run reads, absolute: the training blend's prefixes, then
    ``valid_blend``'s, then ``test_blend``'s (all are checked to share one tokenizer)."""
    weights: tuple
    """Weights of the training blend, one per prefix of ``prefixes[:len(weights)]``."""
    split: Optional[str] = DEFAULT_SPLIT
    """train,valid,test shares of every blend prefix; None when ``valid_blend`` is given."""
    valid_weights: tuple = ()
    """Weights of ``valid_blend``, one per prefix after the blend's; empty: none."""
    test_weights: tuple = ()
    """Weights of ``test_blend``, one per prefix after valid_blend's; empty: none (training
    never reads a test set: it is recorded and checked like the others)."""

    def __post_init__(self):
        if len(self.prefixes) != len(self.weights) + len(self.valid_weights) + len(self.test_weights):
            raise ValueError(f"{len(self.prefixes)} prefixes for {len(self.weights)} blend, "
                             f"{len(self.valid_weights)} valid_blend and {len(self.test_weights)} "
                             f"test_blend weights")
        per_split = bool(self.valid_weights or self.test_weights)
        if per_split and self.split is not None:
            raise ValueError("'split' and 'valid_blend' exclude each other: with valid_blend, "
                             "blend is used entirely for training and valid_blend for validation")
        if not per_split and self.split is None:
            raise ValueError("a data config without valid_blend needs a 'split'")
        train, valid = self.train_blend[0], (self.valid_blend or ((),))[0]
        shared = sorted(set(train) & set(valid))
        if shared:
            raise ValueError(f"{shared} in both blend and valid_blend: validation data must be "
                             f"held out from training")

    def _part(self, i: int) -> Optional[tuple]:
        counts = [len(self.weights), len(self.valid_weights), len(self.test_weights)]
        start = sum(counts[:i])
        if i and not counts[i]:
            return None
        return (list(self.prefixes[start:start + counts[i]]),
                list((self.weights, self.valid_weights, self.test_weights)[i]))

    @property
    def train_blend(self) -> tuple:
        """(prefixes, weights) of ``blend``."""
        return self._part(0)

    @property
    def valid_blend(self) -> Optional[tuple]:
        """(prefixes, weights) of ``valid_blend``, or None when the config has none."""
        return self._part(1)

    @property
    def test_blend(self) -> Optional[tuple]:
        """(prefixes, weights) of ``test_blend``, or None when the config has none."""
        return self._part(2)

    def roles(self) -> list:
        """The role of each prefix: blend, valid_blend or test_blend."""
        return [role for role, part in zip(ROLES, (self.weights, self.valid_weights,
                                                   self.test_weights)) for _ in part]

    def to_dict(self) -> dict:
        """The config as a data config YAML holds it (absolute prefixes; ``load`` reads it)."""
        out: dict = {}
        for role, part in zip(ROLES, (self.train_blend, self.valid_blend, self.test_blend)):
            if part:
                out[role] = [{"prefix": p, "weight": w} for p, w in zip(*part)]
        if self.split is not None:
            out["split"] = self.split
        return out

    @classmethod
    def load(cls, path_or_dict) -> "DataConfig":
        """A data config: a YAML path (or the package's own, by file name) or its dict."""
        import yaml

        if isinstance(path_or_dict, dict):
            raw, bases = path_or_dict, []
        else:
            path = find_config(str(path_or_dict))
            raw = yaml.safe_load(path.read_text()) or {}
            if not isinstance(raw, dict):
                raise ValueError(f"{path} is not a data config (a mapping with blend: ...)")
            bases = [path.parent]
        unknown = set(raw) - {*ROLES, "split", "data_root"}
        if unknown:
            raise ValueError(f"unknown data config keys {sorted(unknown)}")
        root = raw.get("data_root")
        parts = [_entries(raw.get("blend"), "blend", root)]
        parts += [_entries(raw[k], k, root) if k in raw else ([], []) for k in ROLES[1:]]
        split = raw.get("split")
        if "valid_blend" not in raw and "test_blend" not in raw:
            split = str(split if split is not None else DEFAULT_SPLIT)
        args = ((), tuple(parts[0][1]), None if split is None else str(split),
                tuple(parts[1][1]), tuple(parts[2][1]))
        # the config's shape first (a split beside valid_blend, ...), then the files it names
        cls(tuple(p for prefixes, _ in parts for p in prefixes), *args[1:])
        resolved = []
        for role, (prefixes, _) in zip(ROLES, parts):
            for prefix in prefixes:
                try:
                    resolved.append(resolve_prefix(prefix, bases))
                except DataPathError as err:
                    raise DataPathError(f"{role}: {err}") from None
        return cls(tuple(resolved), *args[1:])

    @classmethod
    def from_args(cls, data_path: Optional[Sequence[str]] = None, *, split: Optional[str] = None,
                  train: Optional[Sequence[str]] = None, valid: Optional[Sequence[str]] = None,
                  test: Optional[Sequence[str]] = None) -> "DataConfig":
        """Megatron-LM's flags: ``--data-path`` (a data config YAML, a prefix, or a blend list)
        with ``--split``, or ``--train-data-path`` / ``--valid-data-path`` / ``--test-data-path``."""
        per_split = train or valid or test
        if data_path and per_split:
            raise ValueError("--data-path and --train-data-path/--valid-data-path/"
                             "--test-data-path exclude each other (as in Megatron-LM)")
        if per_split:
            if not train:
                raise ValueError("--valid-data-path/--test-data-path need --train-data-path")
            if split is not None:
                raise ValueError("--split applies to --data-path; with --train-data-path each "
                                 "split has its own datasets")
            raw = {role: _blend_args(values, flag) for role, values, flag in
                   (("blend", train, "--train-data-path"), ("valid_blend", valid,
                    "--valid-data-path"), ("test_blend", test, "--test-data-path")) if values}
            return cls.load(raw)
        if not data_path:
            raise ValueError("no data: give --data-path (or --train-data-path)")
        if len(data_path) == 1 and is_config(data_path[0]):
            if split is not None:
                raise ValueError(f"--split with a data config: give the split in "
                                 f"{data_path[0]} (split: \"{split}\")")
            return cls.load(data_path[0])
        configs = [v for v in data_path if is_config(v)]
        if configs:
            raise ValueError(f"--data-path takes one data config alone, or dataset prefixes; "
                             f"got {' '.join(data_path)}")
        return cls.load({"blend": _blend_args(data_path, "--data-path"),
                         "split": split if split is not None else DEFAULT_SPLIT})


def _blend_args(values, flag: str) -> list:
    prefixes, weights = weighted_list(values, flag)
    prefixes = [resolve_prefix(p) for p in prefixes]
    weights = weights or sizes_as_weights(prefixes)
    return [{"prefix": p, "weight": w} for p, w in zip(prefixes, weights)]


def _entries(entries, key: str, root) -> tuple[list, list]:
    """(prefixes as written, joined to ``data_root``; weights) of one blend of a config."""
    if not entries or not isinstance(entries, list):
        raise ValueError(f"a data config needs a non-empty '{key}' list of {{prefix, weight}}")
    prefixes, weights = [], []
    for entry in entries:
        if not isinstance(entry, dict) or set(entry) - {"prefix", "weight"} or "prefix" not in entry:
            raise ValueError(f"{key} entries are {{prefix, weight}}, got {entry}")
        weight = float(entry.get("weight", 1.0))
        if not weight > 0:
            raise ValueError(f"{key} weight must be positive, got {weight} for {entry['prefix']}")
        prefix = str(entry["prefix"])
        prefixes.append(os.path.join(root, prefix) if root and not os.path.isabs(prefix)
                        else prefix)
        weights.append(weight)
    return prefixes, weights
