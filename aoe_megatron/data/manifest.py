"""The preprocessing manifest beside each dataset (``PREFIX.manifest.json``): written by
``aoe-preprocess`` and ``aoe-verify-data --adopt``, read by training, export and verification."""

from __future__ import annotations

import json
import os

MANIFEST_VERSION = 2  # 2: "files" (size and sha256 of the .bin and the .idx)


def read_manifest(prefix: str) -> dict:
    """The manifest beside a dataset prefix (training and export check it)."""
    path = f"{prefix}.manifest.json"
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} is missing: the dataset was not written by aoe-preprocess: if it was "
            f"tokenized by Megatron-LM, adopt it with `aoe-verify-data --adopt {prefix} "
            f"--tokenizer-model M`, or train on it unadopted with --no-manifest")
    with open(path) as fh:
        return json.load(fh)
