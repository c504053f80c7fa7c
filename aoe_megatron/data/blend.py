"""A data config's datasets: their manifests (one tokenizer and policy across a blend) and the
megatron-core train/valid/test ``GPTDataset``s built from them (``build_datasets``). The config
itself (YAML or Megatron-LM's flags) is ``data/config.py``'s ``DataConfig``."""

from __future__ import annotations

import os
from typing import Optional

from aoe_megatron.data import index_cache
from aoe_megatron.data.adopt import unadopted_manifest
from aoe_megatron.data.config import DataConfig
from aoe_megatron.data.integrity import check_datasets
from aoe_megatron.data.manifest import read_manifest


def read_manifests(prefixes, *, no_manifest: bool = False, tokenizer_model=None,
                   say=None) -> dict:
    """{prefix: its preprocessing manifest}, each file read once.

    ``no_manifest`` (training's ``--no-manifest``): a dataset without a manifest (a Megatron-LM
    corpus not adopted) gets one built in memory from its structure and ``tokenizer_model``
    (``data/adopt.py``: sizes checked, a bounded sample read, nothing hashed), with a warning."""
    out = {}
    for prefix in prefixes:
        if no_manifest and not os.path.isfile(f"{prefix}.manifest.json"):
            out[prefix] = unadopted_manifest(prefix, tokenizer_model, say=say)
            (say or print)(f"WARNING: --no-manifest: {prefix} has no manifest; its structure is "
                           f"checked, its tokenizer taken on trust ({out[prefix]['tokenizer']['path']}"
                           f"), nothing hashed. `aoe-verify-data --adopt {prefix}` records it once.")
        else:
            out[prefix] = read_manifest(prefix)
    return out


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

    ``cache_dir``: where megatron-core keeps the sample indices (``data/index_cache.py``): built
    by global rank 0, read by every rank. None (one process only): a temporary folder, deleted
    after the build; nothing is ever written beside the datasets.
    ``manifests``: the datasets' manifests when already read (a resolved run's).
    A split with 0 samples is not built and comes back as None (an empty split that is built
    would hang megatron-core: ``data/splits.py``). With ``valid_blend``, ``blend`` alone feeds
    the training set and ``valid_blend`` alone the validation set (megatron-core's
    ``blend_per_split``), ``test_blend`` the test set.
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
    if cfg.split is not None:
        blends = dict(blend=cfg.train_blend, split=cfg.split)
    else:
        # NOTE: megatron-core treats all-None blend_per_split as "mock data": never pass that.
        per_split = [b if n else None for b, n in
                     zip((cfg.train_blend, cfg.valid_blend, cfg.test_blend), num_samples)]
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
    if cfg.split is not None:
        # NOTE: megatron-core builds every split of the matrix, asking 0 samples of those no one
        # reads; with no documents in such a split its GPTDataset loops forever. Not built here.
        gpt_cfg.split_matrix = [m if n else None for m, n in zip(gpt_cfg.split_matrix, num_samples)]
        if not any(gpt_cfg.split_matrix):
            return None, None, None
    builder = BlendedMegatronDatasetBuilder(GPTDataset, list(num_samples), lambda: True, gpt_cfg)
    return _build_with_cache(builder, cache_dir)


def _build_with_cache(builder, cache_dir: Optional[str]):
    """``builder.build()`` with its index cache in ``cache_dir`` (a temporary folder if None)."""
    import shutil
    import tempfile

    import torch.distributed as dist

    if not dist.is_initialized():  # megatron-core asks the rank once a cache path is set
        with _one_process_group():
            return _build_with_cache(builder, cache_dir)
    rank = dist.get_rank()
    if cache_dir is None:
        if dist.get_world_size() > 1:
            raise ValueError("build_datasets at world size > 1 needs cache_dir: every rank reads "
                             "the indices rank 0 builds there")
        temporary = tempfile.mkdtemp(prefix="aoe-data-index-")
        try:
            builder.config.path_to_cache = temporary
            return builder.build()  # built in memory on a miss: the folder can go
        finally:
            shutil.rmtree(temporary, ignore_errors=True)
    if rank == 0:
        index_cache.prepare(cache_dir)
    try:
        return builder.build()
    except OSError as err:
        problem = index_cache.unreadable(err, cache_dir, rank)
        if problem is None:
            raise
        raise problem from err


class _one_process_group:
    """A world of one (gloo, in-memory store) for the length of a build in a process without one."""

    def __enter__(self):
        import torch.distributed as dist

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    def __exit__(self, *exc):
        import torch.distributed as dist

        dist.destroy_process_group()
