"""The CUDA paths, as far as a CPU shows them (issue #19), and their real checks on a GPU.

On a CPU every tensor is on the CPU, so a plain run cannot tell whether a collective would be
handed a tensor its group's backend takes. These tests give the training loop's collectives a
communication device other than the CPU (``meta``) and an all-reduce that, like a group started
with plain NCCL, takes tensors on that device only and raises torch's own error for any other.
The ``gpu``-marked tests at the end run the same paths for real (tools/gpu_check.sh).
"""

from __future__ import annotations

import ast
import functools
import os
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from aoe_megatron.runtime import compat
from aoe_megatron.runtime import distributed

ROOT = Path(__file__).resolve().parents[1]


class ReachedCollective(Exception):
    """The collective was handed a tensor on its group's device (where a test stops)."""


@pytest.fixture
def meta_only_group(monkeypatch):
    """A process group whose collectives take ``meta`` tensors only; returns what they saw."""
    seen = []

    def all_reduce(tensor, op=None, group=None, async_op=False):
        seen.append(tensor.device)
        if tensor.device.type != "meta":  # what a group without this device's backend says
            raise RuntimeError(f"No backend type associated with device type {tensor.device.type}")
        raise ReachedCollective

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(distributed, "comm_device", lambda group=None: torch.device("meta"),
                        raising=False)
    return seen


def test_the_steps_agreement_is_reduced_on_the_comm_device(meta_only_group):
    """The step's one collective (loss, non-finite count, stop flag), from a CPU-side loss."""
    from aoe_megatron.train.step import agree_on_step

    with pytest.raises(ReachedCollective):
        agree_on_step(torch.tensor(2.5), stop_raised=True)
    assert meta_only_group == [torch.device("meta")]


def test_losses_are_reduced_on_the_comm_device(meta_only_group):
    """The step and validation losses (``reduce_across_ranks``), from a CPU-side tensor."""
    with pytest.raises(ReachedCollective):
        distributed.reduce_across_ranks(torch.tensor(2.5), op="mean")
    assert meta_only_group == [torch.device("meta")]


def _router_with_even_load(device="cpu"):
    """A stand-in router whose statistics hold one forward: 4 tokens, each expert chosen once."""
    from aoe_megatron.moe.selection_stats import SelectionStats

    stats = SelectionStats(4)
    eye = torch.eye(4, device=device)
    stats.add(eye.bool(), torch.full((4, 4), 0.25, device=device), eye)
    return SimpleNamespace(selection_stats=stats, layer_number=1)


def test_selection_statistics_are_reduced_on_the_comm_device(meta_only_group):
    from aoe_megatron.train.metrics import selection_stats

    router = _router_with_even_load()
    with pytest.raises(ReachedCollective):
        selection_stats(torch.nn.Linear(1, 1), [router])
    assert meta_only_group == [torch.device("meta")]


def test_reduce_across_ranks_on_a_real_group(megatron_world):
    value = torch.tensor([1.0, 4.0])
    for op in ("sum", "mean", "max"):
        torch.testing.assert_close(distributed.reduce_across_ranks(value, op=op), value)
    with pytest.raises(ValueError, match="op must be"):
        distributed.reduce_across_ranks(value, op="min")


TENSOR_COLLECTIVES = {"all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
                      "reduce_scatter", "reduce_scatter_tensor", "reduce", "all_to_all_single"}


def test_training_code_calls_tensor_collectives_only_through_the_comm_device():
    """No module of the training loop hands a tensor to a collective itself: they go through
    ``distributed.reduce_across_ranks`` (object collectives and barriers pick their device)."""
    offenders = []
    for path in sorted((ROOT / "aoe_megatron" / "train").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in TENSOR_COLLECTIVES):
                offenders.append(f"{path.name}:{node.lineno} {node.func.attr}")
    assert not offenders, offenders


@pytest.mark.parametrize("backend,device", [
    ("gloo", "cpu"), ("nccl", "cuda"), ("cpu:gloo,cuda:nccl", "cuda"), ("cuda:gloo", "cuda"),
    ("cpu:gloo", "cpu"),
])
def test_comm_device_follows_the_group_backend(monkeypatch, backend, device):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    expected = torch.device("cuda", 1) if device == "cuda" else torch.device("cpu")
    assert distributed.comm_device() == expected


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch says CUDA is there (one device); what the check caches is cleared around the test."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    _clear_softmax_check()
    yield
    _clear_softmax_check()


def _clear_softmax_check():
    getattr(compat, "fused_softmax_available", functools.cache(bool)).cache_clear()


#: What megatron-core 0.16.1's fusions/fused_softmax.py imports (apex builds them).
SOFTMAX_KERNELS = ("scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda",
                   "scaled_softmax_cuda")


def test_softmax_fusion_only_where_its_kernels_import(fake_cuda, monkeypatch):
    """megatron-core's fused softmax imports apex's compiled kernels at the first bf16 forward:
    without them the model must be built with the fusion off."""
    from aoe_megatron.models.gpt import load_preset, transformer_config

    for name in SOFTMAX_KERNELS:
        monkeypatch.setitem(sys.modules, name, None)  # import fails, as without apex
    cfg = load_preset("tiny")
    assert transformer_config(cfg).masked_softmax_fusion is False
    _clear_softmax_check()
    for name in SOFTMAX_KERNELS:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    assert transformer_config(cfg).masked_softmax_fusion is True


def test_softmax_fusion_is_off_on_cpu():
    _clear_softmax_check()
    assert compat.fused_softmax_available() is False


def test_local_rank_maps_onto_the_devices_a_task_sees(fake_cuda, monkeypatch):
    """srun with one task per GPU: task 3 of a node sees one device, its device 0; DeepSpeed then
    reads the corrected LOCAL_RANK."""
    from aoe_megatron.train.launcher_env import adopt_slurm_env

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # set first: undone at the end either way
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_PROCID", "11")
    monkeypatch.setenv("SLURM_NTASKS", "16")
    monkeypatch.setenv("SLURM_LOCALID", "3")
    adopt_slurm_env()
    assert distributed.local_device_index() == 0
    assert os.environ["LOCAL_RANK"] == "0"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)  # every task sees the node's GPUs
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert distributed.local_device_index() == 3


def test_reading_the_world_size_writes_nothing(monkeypatch):
    """A bare srun: the world size comes from SLURM_NTASKS, and asking for it leaves the
    environment as it was (``adopt_slurm_env``, called once by the entry point, writes it)."""
    from aoe_megatron.train.launcher_env import world_size_from_env

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "16")
    before = dict(os.environ)
    assert world_size_from_env() == 16
    assert dict(os.environ) == before
    monkeypatch.setenv("WORLD_SIZE", "4")  # a launcher's own word wins
    assert world_size_from_env() == 4


# ---- on a GPU (tools/gpu_check.sh) ----------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_training_collectives_on_nccl(megatron_world):
    """On the NCCL group megatron_world starts: the step's agreement, a loss and the statistics."""
    from aoe_megatron.train.metrics import selection_stats
    from aoe_megatron.train.step import agree_on_step

    assert dist.get_backend() == "nccl" and distributed.comm_device().type == "cuda"
    assert agree_on_step(torch.tensor(2.5, device="cuda"), stop_raised=True) == (2.5, 0, True)
    loss = torch.tensor(2.5, device="cuda")
    assert distributed.reduce_across_ranks(loss, op="mean").item() == 2.5
    router = _router_with_even_load("cuda")
    assert selection_stats(torch.nn.Linear(1, 1), [router])[1]["load"] == [0.25] * 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_forward_with_the_softmax_gate(megatron_world):
    """A bf16 forward of shapes the fused softmax takes (it needs apex's kernels when enabled)."""
    from aoe_megatron.models.gpt import build_gpt_model, load_preset, transformer_config

    cfg = load_preset("tiny")
    tc = transformer_config(cfg, bf16=True, params_dtype=torch.bfloat16)
    assert tc.masked_softmax_fusion is compat.fused_softmax_available()
    model = build_gpt_model(cfg, tc).cuda()
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), device="cuda")
    position_ids = torch.arange(cfg.seq_length, device="cuda").unsqueeze(0).expand(2, -1)
    loss = model(tokens, position_ids, None, labels=tokens).float().mean()
    assert torch.isfinite(loss)
