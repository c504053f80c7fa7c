"""The process groups of a cluster job, built without a cluster: a 64-rank job (8 nodes x 8 GPUs,
EP 8) set up rank by rank in one process over torch's fake process group, through our own
``init_megatron`` and ``prepare_experts_for_deepspeed``.

Rank order is the Slurm template's (run/slurm/pretrain.sbatch): one torchrun agent per node with
``--nproc_per_node 8``, so global rank = node rank x 8 + local rank (torchrun gives each agent a
contiguous block of ranks).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

NODES, GPUS, EP = 8, 8, 8
pytestmark = pytest.mark.legs  # megatron-core builds the groups: both releases

_SCRIPT = r"""
import json, sys
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import aoe_megatron
from aoe_megatron.runtime.distributed import init_megatron
from aoe_megatron.train.engine import prepare_experts_for_deepspeed
from deepspeed.utils import groups as ds_groups
from megatron.core import parallel_state as ps

world, ep = int(sys.argv[1]), int(sys.argv[2])
asked = []  # the backend of every group megatron-core (or we) asked for
new_group = dist.new_group

def recording(*args, **kwargs):
    asked.append(str(kwargs.get("backend")))
    return new_group(*args, **kwargs)

dist.new_group = recording
out = {"ranks": {}, "backends": asked}
for rank in range(world):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    init_megatron(rank=rank, world_size=world, expert_parallel_size=ep)
    model = torch.nn.Linear(2, 2)
    model.weight.allreduce = False  # one expert weight is enough to register the groups
    prepare_experts_for_deepspeed(model, num_experts=ep, ep_size=ep)
    name = f"ep_size_{ep}"
    ranks = dist.get_process_group_ranks
    out["ranks"][rank] = {
        "ep": ranks(ps.get_expert_model_parallel_group()),
        "edp": ranks(ps.get_expert_data_parallel_group()),
        "dp": ranks(ps.get_data_parallel_group()),
        "ds_ep": ds_groups._EXPERT_PARALLEL_GROUP_RANKS[name],
        "ds_edp": ds_groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name],
        "ds_edp_group": ranks(ds_groups._EXPERT_DATA_PARALLEL_GROUP[name]),
        "gloo": [n for n in ("_DATA_PARALLEL_GROUP_GLOO", "_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
                             "_EXPERT_DATA_PARALLEL_GROUP_GLOO") if getattr(ps, n) is not None],
    }
    ps.destroy_model_parallel()
    dist.destroy_process_group()
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def cluster_groups():
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(NODES * GPUS), str(EP)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(line[-1][len("RESULT "):])
    return {int(r): g for r, g in out["ranks"].items()}, out["backends"]


def test_no_gloo_groups_are_built(cluster_groups):
    """megatron-core's default builds gloo groups (DP, DP-with-CP, expert-DP) that connect every
    pair of ranks over TCP at start-up; nothing of ours uses them, so none is asked for."""
    groups, backends = cluster_groups
    assert backends, "no group was recorded: the check would pass vacuously"
    assert "gloo" not in backends, sorted(set(backends))
    assert all(not g["gloo"] for g in groups.values()), groups[0]["gloo"]


def test_expert_groups_stay_inside_a_node(cluster_groups):
    groups, _ = cluster_groups
    assert sorted(groups) == list(range(NODES * GPUS))
    seen = set()
    for rank, g in groups.items():
        node = rank // GPUS
        assert rank in g["ep"] and len(g["ep"]) == EP
        assert {r // GPUS for r in g["ep"]} == {node}, (rank, g["ep"])  # the all-to-all on NVLink
        seen.add(tuple(g["ep"]))
        assert g["dp"] == list(range(NODES * GPUS))  # TP = PP = 1: every rank is data-parallel
    assert len(seen) == NODES


def test_expert_data_parallel_groups_are_what_deepspeed_gets(cluster_groups):
    """An expert's replicas (one per node, same local rank) reduce its gradients together, and
    DeepSpeed reduces expert weights over exactly megatron-core's groups."""
    groups, _ = cluster_groups
    for rank, g in groups.items():
        assert g["edp"] == [node * GPUS + rank % GPUS for node in range(NODES)], (rank, g["edp"])
        assert g["ds_edp"] == g["edp"] and g["ds_edp_group"] == g["edp"]
        assert g["ds_ep"] == g["ep"]
