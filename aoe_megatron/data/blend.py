"""Data configs (YAML: weighted dataset prefixes) to megatron-core train/valid/test datasets.

    blend:
      - {prefix: data/redpajama_common_crawl_text_document, weight: 67.0}
      - {prefix: data/redpajama_c4_text_document, weight: 15.0}
    split: "969,30,1"          # train, valid, test shares of every prefix
    data_root: /datasets       # optional; relative prefixes are joined to it (else to the CWD)

or, with a held-out validation set (no split: ``blend`` is all training, ``valid_blend`` all
validation, and there is no test set):

    blend:
      - {prefix: data/study_train_text_document, weight: 1.0}
    valid_blend:
      - {prefix: data/study_valid_text_document, weight: 1.0}

Every prefix must have the manifest written by aoe-preprocess, all with one tokenizer
(and the tokenizer given to training, when one is): a run never mixes tokenizers silently.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from aoe_megatron.data.integrity import check_datasets
from aoe_megatron.data.preprocess import read_manifest

DEFAULT_SPLIT = "969,30,1"


@dataclass(frozen=True)
class DataConfig:
    prefixes: tuple
    """Every dataset the run reads: the training blend's prefixes, then ``valid_blend``'s (all
    are checked to share one tokenizer)."""
    weights: tuple
    """Weights of the training blend, one per prefix of ``prefixes[:len(weights)]``."""
    split: Optional[str] = DEFAULT_SPLIT
    """train,valid,test shares of every blend prefix; None when ``valid_blend`` is given."""
    valid_weights: tuple = ()
    """Weights of ``valid_blend``, one per prefix of ``prefixes[len(weights):]``; empty: none."""

    def __post_init__(self):
        if len(self.prefixes) != len(self.weights) + len(self.valid_weights):
            raise ValueError(f"{len(self.prefixes)} prefixes for {len(self.weights)} blend and "
                             f"{len(self.valid_weights)} valid_blend weights")
        if self.valid_weights and self.split is not None:
            raise ValueError("'split' and 'valid_blend' exclude each other: with valid_blend, "
                             "blend is used entirely for training and valid_blend for validation")
        if not self.valid_weights and self.split is None:
            raise ValueError("a data config without valid_blend needs a 'split'")
        train, valid = self.train_blend[0], (self.valid_blend or ((),))[0]
        shared = sorted(set(train) & set(valid))
        if shared:
            raise ValueError(f"{shared} in both blend and valid_blend: validation data must be "
                             f"held out from training")

    @property
    def train_blend(self) -> tuple:
        """(prefixes, weights) of ``blend``."""
        n = len(self.weights)
        return list(self.prefixes[:n]), list(self.weights)

    @property
    def valid_blend(self) -> Optional[tuple]:
        """(prefixes, weights) of ``valid_blend``, or None when the config has none."""
        if not self.valid_weights:
            return None
        return list(self.prefixes[len(self.weights):]), list(self.valid_weights)

    @classmethod
    def load(cls, path_or_dict) -> "DataConfig":
        import yaml

        if isinstance(path_or_dict, dict):
            raw = path_or_dict
        else:
            raw = yaml.safe_load(Path(path_or_dict).read_text()) or {}
        unknown = set(raw) - {"blend", "valid_blend", "split", "data_root"}
        if unknown:
            raise ValueError(f"unknown data config keys {sorted(unknown)}")
        root = raw.get("data_root")
        prefixes, weights = _entries(raw.get("blend"), "blend", root)
        if "valid_blend" not in raw:
            return cls(tuple(prefixes), tuple(weights), str(raw.get("split", DEFAULT_SPLIT)))
        valid_prefixes, valid_weights = _entries(raw["valid_blend"], "valid_blend", root)
        # a split given beside valid_blend is refused by __post_init__
        return cls(tuple(prefixes + valid_prefixes), tuple(weights), raw.get("split"),
                   tuple(valid_weights))


def _entries(entries, key: str, root) -> tuple[list, list]:
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
        if root and not os.path.isabs(prefix):
            prefix = os.path.join(root, prefix)
        prefixes.append(prefix)
        weights.append(weight)
    return prefixes, weights


def read_manifests(prefixes) -> dict:
    """{prefix: its preprocessing manifest}, each file read once."""
    return {p: read_manifest(p) for p in prefixes}


def check_manifests(prefixes, tokenizer_sha256: Optional[str] = None, *,
                    manifests: Optional[dict] = None) -> dict:
    """All prefixes share one tokenizer and BOS/EOD policy (and match ``tokenizer_sha256``);
    returns the first manifest. ``manifests``: those already read (``read_manifests``)."""
    manifests = read_manifests(prefixes) if manifests is None else manifests
    first_prefix, first = next(iter(manifests.items()))
    for prefix, m in manifests.items():
        for field in ("tokenizer", "policy"):
            mine = m[field]["sha256"] if field == "tokenizer" else m[field]
            theirs = first[field]["sha256"] if field == "tokenizer" else first[field]
            if mine != theirs:
                raise ValueError(
                    f"{prefix} and {first_prefix} differ in {field}: {mine} vs {theirs}; "
                    f"preprocess every dataset of a blend with one tokenizer and policy"
                )
    if tokenizer_sha256 and first["tokenizer"]["sha256"] != tokenizer_sha256:
        raise ValueError(
            f"the datasets were tokenized with {first['tokenizer']['path']} "
            f"(sha256 {first['tokenizer']['sha256'][:12]}...), not the tokenizer given "
            f"(sha256 {tokenizer_sha256[:12]}...)"
        )
    return first


class MegatronTokenizerView:
    """What megatron-core's GPTDataset reads from a tokenizer, from a preprocessing manifest."""

    def __init__(self, manifest: dict, data_digest: Optional[str] = None):
        tok = manifest["tokenizer"]
        self.vocab_size = tok["vocab_size"]
        self.eod = self.eos = tok["eos_id"]
        self.bos = tok["bos_id"]
        # megatron-core keys its cached dataset indices ({prefix}/cache/) by these identifiers,
        # the paths, split, seed and sizes, not by the data: the digest of the datasets' contents
        # keeps data re-preprocessed into the same prefix from reusing stale indices.
        self.unique_identifiers = {"class": type(self).__name__, "sha256": tok["sha256"],
                                   "data": data_digest}


def data_digest(prefixes, manifests: Optional[dict] = None) -> str:
    """A digest of what the datasets hold, from their manifests and file sizes (cheap)."""
    import hashlib
    import json

    manifests = read_manifests(prefixes) if manifests is None else manifests
    parts = []
    for prefix in prefixes:
        m = manifests[prefix]
        sizes = [os.path.getsize(f"{prefix}{ext}") for ext in (".bin", ".idx")
                 if os.path.exists(f"{prefix}{ext}")]
        parts.append([m.get("documents"), m.get("tokens"),
                      [src.get("sha256") for src in m.get("sources", [])], sizes])
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def build_datasets(data_config, *, seq_length: int, seed: int, num_samples,
                   tokenizer_sha256: Optional[str] = None, cache_dir: Optional[str] = None,
                   manifests: Optional[dict] = None):
    """(train, valid, test) GPTDatasets over the blend; ``num_samples`` = (train, valid, test).

    ``manifests``: the datasets' manifests when already read (a resolved run's).
    A split with 0 samples comes back as None. With ``valid_blend``, ``blend`` alone feeds the
    training set and ``valid_blend`` alone the validation set (megatron-core's
    ``blend_per_split``); the test set is None.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    cfg = data_config if isinstance(data_config, DataConfig) else DataConfig.load(data_config)
    if manifests is None:  # a resolved run's were checked before its process group started
        manifests = read_manifests(cfg.prefixes)
        check_datasets(manifests)
    manifest = check_manifests(cfg.prefixes, tokenizer_sha256, manifests=manifests)
    if not manifest["policy"]["append_eod"]:
        raise ValueError("training needs documents separated by EOD: preprocess with --append-eod")
    if cfg.valid_blend is None:
        blends = dict(blend=(list(cfg.prefixes), list(cfg.weights)), split=cfg.split)
    else:
        # NOTE: megatron-core treats all-None blend_per_split as "mock data": never pass that.
        per_split = [b if n else None for b, n in zip((cfg.train_blend, cfg.valid_blend, None),
                                                       num_samples)]
        if not any(per_split):
            return None, None, None
        blends = dict(blend_per_split=per_split)
    gpt_cfg = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        **blends,
        tokenizer=MegatronTokenizerView(manifest, data_digest(cfg.prefixes, manifests)),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=cache_dir,
        mmap_bin_files=True,
    )
    return BlendedMegatronDatasetBuilder(
        GPTDataset, list(num_samples), lambda: True, gpt_cfg
    ).build()
