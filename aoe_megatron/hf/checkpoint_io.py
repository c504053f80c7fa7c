"""Streaming access to training checkpoints and safetensors files, one tensor (slice) at a time.

``CheckpointReader`` reads slices of the global tensors of a megatron-core ``torch_dist``
checkpoint (``step_N/model/``) without a process group and without loading the rest, so memory
stays near the largest slice asked for. ``SafetensorsWriter`` writes a sharded safetensors
model whose header is planned up front, then streams tensors in that order. ``staged_output``
publishes a conversion's folder whole or not at all.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import struct
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Optional

import torch

from aoe_megatron.checkpoint import layout


class ConversionError(RuntimeError):
    """A conversion input is unusable; the message names the file and what to do."""


@contextmanager
def staged_output(out: Path, overwrite: bool):
    """Yields ``OUT.partial-HOST-PID`` to write into; renamed to ``out`` on success, removed on
    any failure: a conversion is published whole or not at all."""
    if out.exists() and not overwrite:
        raise ConversionError(
            f"output folder {out} already exists: choose a new path, remove it, or pass --overwrite "
            f"(it is replaced only once the new conversion is complete)"
        )
    tmp = out.parent / f"{out.name}.partial-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)


def resolve_checkpoint(path) -> Path:
    """A checkpoint directory (``step_N``), or a ``--ckpt-dir`` whose ``latest`` names one."""
    try:
        path = layout.resolve(path)
    except layout.CheckpointNotFound as err:
        raise ConversionError(str(err)) from None
    for needed in (layout.state_path(path), path / "model" / ".metadata"):
        if not needed.is_file():
            raise ConversionError(
                f"{needed} is missing: {path} is not a complete aoe-megatron checkpoint "
                f"(pass a step_N directory, or the --ckpt-dir holding `{layout.LATEST}`)"
            )
    return path


def _into_tensor_planner():
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class IntoTensor(DefaultLoadPlanner):
        """Every read lands in one plain tensor (a slice of the global one), not a state dict."""

        def __init__(self, target: torch.Tensor):
            super().__init__()
            self.target = target

        def lookup_tensor(self, index):
            return self.target

    return IntoTensor


#: Layer norms some specs save under another key: ours (megatron-core's local spec maps the norms
#: onto TE's fused norm-linear keys through ``sharded_state_dict_keys_map``, and our TE spec does
#: too) -> that of a layer keeping the norm as a module of its own, unmapped (stock Megatron-LM's
#: TE spec: its MoE layers have a separate TENorm ``pre_mlp_layernorm``).
NORM_KEY_ALIASES = {
    "decoder.layers.self_attention.linear_qkv.layer_norm_weight": "decoder.layers.input_layernorm.weight",
    "decoder.layers.mlp.linear_fc1.layer_norm_weight": "decoder.layers.pre_mlp_layernorm.weight",
}


def _our_names(stored_keys, path) -> dict:
    """{our key: stored key} for the norms stored under their other name."""
    renamed = {}
    for ours, other in NORM_KEY_ALIASES.items():
        if other in stored_keys and ours in stored_keys:
            raise ConversionError(f"{path} holds both {ours!r} and {other!r}: the same norm saved "
                                  f"in two layouts; it was not written by one model")
        if other in stored_keys:
            renamed[ours] = other
    return renamed


class CheckpointReader:
    """Slices of the model tensors of one checkpoint (``resolve_checkpoint`` output).

    Keys are this project's layout whichever spec wrote the checkpoint: a norm saved under its
    ``NORM_KEY_ALIASES`` name (stock Megatron-LM's TE spec) is listed and read under ours.
    """

    def __init__(self, path):
        from torch.distributed.checkpoint import FileSystemReader

        self.path = resolve_checkpoint(path)
        self.state = layout.read_state(self.path)
        model_dir = self.path / "model"
        self._reader = FileSystemReader(str(model_dir))
        self.metadata = self._reader.read_metadata()
        files = {info.relative_path for info in self.metadata.storage_data.values()}
        missing = sorted(f for f in files if not (model_dir / f).is_file())
        if missing:
            raise ConversionError(
                f"checkpoint shard {model_dir / missing[0]} is missing ({len(missing)} of {len(files)} "
                f"shard files absent): the checkpoint is incomplete; copy the whole step directory "
                f"again or convert an earlier checkpoint"
            )
        self._reader.set_up_storage_reader(self.metadata, is_coordinator=True)
        self._stored = _our_names(self.metadata.state_dict_metadata, model_dir)
        self._planner = _into_tensor_planner()  # a class made once: no cycle holds a slice

    def tensors(self) -> dict:
        """Every tensor key with its global shape (non-tensor entries left out)."""
        ours = {stored: key for key, stored in self._stored.items()}
        return {ours.get(k, k): tuple(v.size) for k, v in self.metadata.state_dict_metadata.items()
                if hasattr(v, "size")}

    def _meta(self, key: str):
        try:
            return self.metadata.state_dict_metadata[self._stored.get(key, key)]
        except KeyError:
            raise ConversionError(f"{self.path / 'model'} has no tensor {key!r}") from None

    def shape(self, key: str) -> tuple:
        return tuple(self._meta(key).size)

    def read(self, key: str, index: Optional[int] = None) -> torch.Tensor:
        """The global tensor ``key``, or its ``index``-th slice along axis 0 (a layer)."""
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        shape, meta, stored = self.shape(key), self._meta(key), self._stored.get(key, key)
        offsets = [0] * len(shape)
        sizes = list(shape)
        if index is not None:
            offsets[0], sizes[0] = index, 1
        target = torch.empty(sizes, dtype=meta.properties.dtype)
        planner = self._planner(target)
        planner.set_up_planner({stored: target}, self.metadata, is_coordinator=True)
        items = create_read_items_for_chunk_list(
            stored, meta, [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))]
        )
        covered = sum(math.prod(item.lengths) for item in items)
        if covered != target.numel():
            raise ConversionError(
                f"{self.path / 'model'}: the saved chunks of {key!r} cover {covered} of "
                f"{target.numel()} elements of the requested slice; the shards do not match "
                f"the checkpoint's layout {self.state.get('layout')}"
            )
        self._reader.read_data(LoadPlan(items), planner).wait()
        return target[0] if index is not None else target


_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


class SafetensorsWriter:
    """Writes ``entries`` ([(name, shape, dtype)], in write order) as safetensors shards.

    The headers are known before any data, so each tensor goes to disk as it is produced;
    ``write`` must be called once per entry, in order. One file ``model.safetensors`` when
    everything fits in ``max_shard_bytes``, else ``model-0000i-of-0000n.safetensors`` plus
    ``model.safetensors.index.json``.
    """

    def __init__(self, folder, entries: Iterable, *, max_shard_bytes: int, metadata=None):
        self.folder = Path(folder)
        self.entries = [(n, tuple(s), d) for n, s, d in entries]
        shards, current, size = [], [], 0
        for entry in self.entries:
            nbytes = math.prod(entry[1]) * entry[2].itemsize
            if current and size + nbytes > max_shard_bytes:
                shards.append(current)
                current, size = [], 0
            current.append(entry)
            size += nbytes
        shards.append(current)
        n = len(shards)
        self.files = ["model.safetensors"] if n == 1 else [
            f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self.shards = shards
        self.metadata = {"format": "pt", **(metadata or {})}
        self._next = 0  # index into self.entries
        self._shard = -1
        self._fh = None
        self._left_in_shard = 0

    def _open_next_shard(self) -> None:
        if self._fh:
            self._fh.close()
        self._shard += 1
        header, offset = {"__metadata__": self.metadata}, 0
        for name, shape, dtype in self.shards[self._shard]:
            nbytes = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._fh = open(self.folder / self.files[self._shard], "wb")
        self._fh.write(struct.pack("<Q", len(raw)) + raw)
        self._left_in_shard = len(self.shards[self._shard])

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want_name, shape, dtype = self.entries[self._next]
        if name != want_name or tuple(tensor.shape) != shape:
            raise RuntimeError(f"expected {want_name} {shape}, got {name} {tuple(tensor.shape)}")
        if self._left_in_shard == 0:
            self._open_next_shard()
        data = tensor.detach().to("cpu", dtype).contiguous()
        self._fh.write(data.view(torch.uint8).numpy().data if data.numel() else b"")
        self._next += 1
        self._left_in_shard -= 1

    def close(self) -> None:
        if self._next != len(self.entries):
            raise RuntimeError(f"{len(self.entries) - self._next} tensors were never written")
        if self._fh:
            self._fh.close()
        if len(self.files) > 1:
            weight_map = {name: self.files[i] for i, shard in enumerate(self.shards) for name, _, _ in shard}
            total = sum(math.prod(s) * d.itemsize for _, s, d in self.entries)
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
