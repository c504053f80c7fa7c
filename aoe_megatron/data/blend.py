"""Data configs (YAML: weighted dataset prefixes) to megatron-core train/valid/test datasets.

    blend:
      - {prefix: data/redpajama_common_crawl_text_document, weight: 67.0}
      - {prefix: data/redpajama_c4_text_document, weight: 15.0}
    split: "969,30,1"          # train, valid, test shares of every prefix
    data_root: /datasets       # optional; relative prefixes are joined to it (else to the CWD)

Every prefix must have the manifest written by tools/preprocess_data.py, all with one tokenizer
(and the tokenizer given to training, when one is): a run never mixes tokenizers silently.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from aoe_megatron.data.preprocess import read_manifest


@dataclass(frozen=True)
class DataConfig:
    prefixes: tuple
    weights: tuple
    split: str = "969,30,1"

    @classmethod
    def load(cls, path_or_dict) -> "DataConfig":
        import yaml

        if isinstance(path_or_dict, dict):
            raw = path_or_dict
        else:
            raw = yaml.safe_load(Path(path_or_dict).read_text()) or {}
        unknown = set(raw) - {"blend", "split", "data_root"}
        if unknown:
            raise ValueError(f"unknown data config keys {sorted(unknown)}")
        entries = raw.get("blend") or []
        if not entries:
            raise ValueError("a data config needs a non-empty 'blend' list of {prefix, weight}")
        root = raw.get("data_root")
        prefixes, weights = [], []
        for entry in entries:
            if set(entry) - {"prefix", "weight"} or "prefix" not in entry:
                raise ValueError(f"blend entries are {{prefix, weight}}, got {entry}")
            weight = float(entry.get("weight", 1.0))
            if not weight > 0:
                raise ValueError(f"blend weight must be positive, got {weight} for {entry['prefix']}")
            prefix = str(entry["prefix"])
            if root and not os.path.isabs(prefix):
                prefix = os.path.join(root, prefix)
            prefixes.append(prefix)
            weights.append(weight)
        return cls(tuple(prefixes), tuple(weights), str(raw.get("split", "969,30,1")))


def check_manifests(prefixes, tokenizer_sha256: Optional[str] = None) -> dict:
    """All prefixes share one tokenizer and BOS/EOD policy (and match ``tokenizer_sha256``)."""
    manifests = {p: read_manifest(p) for p in prefixes}
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

    def __init__(self, manifest: dict):
        tok = manifest["tokenizer"]
        self.vocab_size = tok["vocab_size"]
        self.eod = self.eos = tok["eos_id"]
        self.bos = tok["bos_id"]
        self.unique_identifiers = {"class": type(self).__name__, "sha256": tok["sha256"]}


def build_datasets(data_config, *, seq_length: int, seed: int, num_samples,
                   tokenizer_sha256: Optional[str] = None, cache_dir: Optional[str] = None):
    """(train, valid, test) GPTDatasets over the blend; ``num_samples`` = (train, valid, test).

    A split with 0 samples comes back as None.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    cfg = data_config if isinstance(data_config, DataConfig) else DataConfig.load(data_config)
    manifest = check_manifests(cfg.prefixes, tokenizer_sha256)
    if not manifest["policy"]["append_eod"]:
        raise ValueError("training needs documents separated by EOD: preprocess with --append-eod")
    gpt_cfg = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=(list(cfg.prefixes), list(cfg.weights)),
        split=cfg.split,
        tokenizer=MegatronTokenizerView(manifest),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        path_to_cache=cache_dir,
        mmap_bin_files=True,
    )
    return BlendedMegatronDatasetBuilder(
        GPTDataset, list(num_samples), lambda: True, gpt_cfg
    ).build()
