"""Checkpoints and held-out tokens for the study's tools (the norm probe, the evaluation): find and
verify a checkpoint (its model: ``aoe_megatron.checkpoint.model.load_model``), a one-rank
megatron world, validation windows from a data config."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Optional

import torch

from aoe_megatron.checkpoint import layout
from aoe_megatron.checkpoint.integrity import require_verified
from aoe_megatron.data.blend import build_datasets
from aoe_megatron.runtime.distributed import init_megatron, shutdown


class StudyInputError(ValueError):
    """Bad input to the study's tools (their command lines exit with 2)."""


def open_checkpoint(path, *, what: str, verify: bool = True) -> tuple:
    """(step_dir, state) of a checkpoint or ckpt dir (its latest), verified before anything of it
    is read: ``integrity.CheckpointDamaged`` (a ValueError: the tools exit 2) names each damaged
    file; ``verify=False`` (--no-verify) reads it unchecked, with a warning on stderr."""
    step_dir = layout.resolve(path)  # CheckpointNotFound: a ValueError, as StudyInputError
    require_verified(step_dir, verify=verify, what=what,
                     log=lambda msg: print(msg, file=sys.stderr, flush=True))
    return step_dir, layout.read_state(step_dir)


@contextmanager
def megatron_world(seed: int = 0):
    """A one-rank megatron world for this process unless one is up (then left as it is)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    started = not (dist.is_initialized() and parallel_state.model_parallel_is_initialized())
    if started:
        init_megatron(rank=0, world_size=1, expert_parallel_size=1, seed=seed)
    try:
        yield
    finally:
        if started:
            shutdown()


def heldout_windows(data, *, sequences: int, seq_length: int, seed: int,
                    tokenizer_sha256: Optional[str] = None) -> torch.Tensor:
    """[sequences, seq_length + 1] windows of the data config's validation split."""
    _, valid, _ = build_datasets(data, seq_length=seq_length, seed=seed, num_samples=(0, sequences, 0),
                                 tokenizer_sha256=tokenizer_sha256)
    if valid is None:
        raise StudyInputError(f"{data} has no validation split (its split gives validation 0)")
    rows = []
    for i in range(sequences):
        item = valid[i]  # tokens[t + 1] == labels[t]: rebuild the (seq_length + 1) window
        rows.append(torch.cat([torch.as_tensor(item["tokens"]), torch.as_tensor(item["labels"])[-1:]]))
    return torch.stack(rows).long()
