"""Each patch in patches/ is needed (upstream fails on a CPU-only machine) and works.

Each test runs the upstream code path with only that patch removed (it must fail), then with all
patches applied (it must give the right answer).
"""

from __future__ import annotations

import contextlib
import importlib
import os
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from aoe_megatron import patches
from aoe_megatron.patches import (
    ALL_PATCHES,
    DEEPSPEED_PATCHES,
    deepspeed_comm_torch,
    mcore_dist_ckpt_filesystem_async,
    mcore_dist_ckpt_state_dict_saver,
    mcore_dist_ckpt_write_digests,
    mcore_jit,
    mcore_moe_router,
    mcore_moe_token_dispatcher,
    mcore_moe_utils,
    mcore_rotary_pos_embedding,
    mcore_tensor_parallel_mappings,
    mcore_tensor_parallel_random,
    mcore_transformer_utils,
    mcore_utils,
    mcore_wandb_import,
)
from aoe_megatron.runtime.versions import SUPPORTED_MCORE, installed_mcore
from tests.helpers import make_transformer_config, run_distributed

pytestmark = pytest.mark.legs  # every patch, on each CI leg
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU patches apply without CUDA only")
CUDA_MISSING = (AssertionError, RuntimeError)  # "Torch not compiled with CUDA enabled"


@contextlib.contextmanager
def without(patch):
    """All patches but ``patch`` applied; everything re-applied afterwards."""
    patches.revert_patches()
    for p in patches.active_patches():
        if p is not patch:
            p.apply()
    try:
        yield
    finally:
        patches.revert_patches()
        patches.apply_patches()


def test_every_patch_module_is_registered_and_documented():
    import pkgutil

    names = {m.name for m in pkgutil.iter_modules(patches.__path__) if m.name.startswith("mcore_")}
    assert names == {p.__name__.split(".")[-1] for p in ALL_PATCHES}
    for p in ALL_PATCHES:
        assert p.VERSIONS and set(p.VERSIONS) <= set(SUPPORTED_MCORE), p.__name__
        first_line = p.__doc__.splitlines()[0]
        assert all(v in first_line for v in p.VERSIONS), (p.__name__, first_line)
        assert "Why:" in p.__doc__ and "What:" in p.__doc__, p.__name__
        __import__(p.TARGET)  # the upstream file it names exists in the installed release
    names = {m.name for m in pkgutil.iter_modules(patches.__path__) if m.name.startswith("deepspeed_")}
    assert names == {p.__name__.split(".")[-1] for p in DEEPSPEED_PATCHES}
    for p in DEEPSPEED_PATCHES:
        assert "0.19.8" in p.__doc__ and "Why:" in p.__doc__ and "What:" in p.__doc__, p.__name__


@cpu_only
def test_deepspeed_starts_on_the_cpu_without_compiling_its_shared_memory_op(monkeypatch):
    """Upstream JIT-compiles the op on every CPU start (about 35 s the first time on a machine);
    patched, the backend starts without it and never builds it."""
    from aoe_megatron.train.engine import import_deepspeed

    deepspeed = import_deepspeed()
    comm, builds = importlib.import_module(deepspeed_comm_torch.TARGET), []
    builder = type(deepspeed.accelerator.get_accelerator().create_op_builder("ShareMemCommBuilder"))
    monkeypatch.setattr(builder, "load", lambda self, verbose=False: builds.append(self.NAME))
    if not deepspeed.ops.__compatible_ops__.get(builder.NAME):
        pytest.skip("no C++ compiler here: upstream would not build the op either")
    with without(deepspeed_comm_torch):
        comm.build_shm_op()
        assert builds == ["deepspeed_shm_comm"]  # upstream: a compile (here a stub)
    assert "deepspeed_comm_torch" in patches.apply_deepspeed_patches()
    assert comm.build_shm_op() is None and builds == ["deepspeed_shm_comm"]


_KERNELS_AT_IMPORT = """
import os, sys
import torch
os.environ["DS_ACCELERATOR"] = "cpu"
if sys.argv[1] == "patched":
    import aoe_megatron  # arms mcore_jit
    from aoe_megatron.train.engine import import_deepspeed
    import_deepspeed()
else:
    import deepspeed
from megatron.core.fusions import fused_bias_swiglu
from deepspeed.runtime.zero.muon import original_muon
plain = [not hasattr(f, "_torchdynamo_orig_callable") for f in
         (fused_bias_swiglu.swiglu, original_muon.muon_update, original_muon.zeropower_via_newtonschulz5)]
print(*plain, "torch._inductor.compile_fx" in sys.modules)
if sys.argv[1] == "patched":  # eager: what the compiled kernel computes (never run here upstream:
    y = torch.randn(4, 6, dtype=torch.float64)  # Inductor would build it with the C++ compiler)
    a, b = y.chunk(2, -1)
    torch.testing.assert_close(fused_bias_swiglu.swiglu(y), torch.nn.functional.silu(a) * b)
"""


@cpu_only
@pytest.mark.parametrize("mode", ["unpatched", "patched"])
def test_no_torch_compile_wrappers_built_on_the_cpu(mode):
    """megatron-core (its jit_fuser) and DeepSpeed's Muon module (loaded by ZeRO 1/2 on their
    first reduction) wrap kernels in ``torch.compile`` as they import, which loads Inductor's
    compiler (about a second per process): ``mcore_jit`` and ``deepspeed_runtime_compiler`` leave
    them plain functions, and Inductor's compiler unloaded."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _KERNELS_AT_IMPORT, mode], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    flags = done.stdout.split()
    if mode == "unpatched":
        assert flags == ["False", "False", "False", "True"]
    else:
        assert flags == ["True", "True", "True", "False"]
        assert mcore_jit.apply() is True  # in process: already in place, nothing to change
        assert patches.apply_deepspeed_patches()[-1] == "deepspeed_runtime_compiler"


_ROUTER_AT_IMPORT = """
import sys
import aoe_megatron  # arms every import hook of this release
from aoe_megatron.patches import mcore_moe_router
if sys.argv[1] == "unpatched":  # the router's hook taken back out, mcore_jit's left in
    sys.meta_path[:] = [f for f in sys.meta_path if getattr(f, "name", None) != mcore_moe_router.TARGET]
import megatron.core.transformer.moe.router
print("torch._dynamo" in sys.modules, "torch._inductor.compile_fx" in sys.modules)
"""


@cpu_only
def test_the_router_module_compiles_nothing_at_import():
    """0.19.2's router.py wraps a kernel in a bare ``@torch.compile`` as it loads: without
    ``mcore_moe_router``'s hook that loads TorchDynamo and Inductor's compiler; with it, neither.
    0.16.1 has no such decorator (the hook is off there, and unneeded)."""
    import subprocess
    import sys

    def loaded(mode):
        done = subprocess.run([sys.executable, "-c", _ROUTER_AT_IMPORT, mode], capture_output=True,
                              text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.split()

    if installed_mcore() not in mcore_moe_router.COMPILED_AT_IMPORT:  # unneeded: nothing to hook
        import inspect

        from megatron.core.transformer.moe import router

        assert "@torch.compile" not in inspect.getsource(router)
        return
    assert loaded("unpatched") == ["True", "True"]
    assert loaded("patched") == ["False", "False"]


_WANDB_AT_IMPORT = """
import importlib.metadata, sys
import aoe_megatron  # arms every import hook of this release
from aoe_megatron.patches import mcore_wandb_import
if sys.argv[1] == "unpatched":  # the wandb hook taken back out
    sys.meta_path[:] = [f for f in sys.meta_path if getattr(f, "name", None) != "wandb"]
import megatron.core.transformer.moe.moe_layer
from megatron.core.inference.contexts import dynamic_context
import wandb
print("wandb.sdk" in sys.modules, dynamic_context.HAVE_WANDB, dynamic_context.wandb is wandb)
assert wandb.__version__ == importlib.metadata.version("wandb")  # the first use runs it, in place
import wandb as again
print("wandb.sdk" in sys.modules, again is wandb, callable(wandb.init), mcore_wandb_import.is_deferred(wandb))
"""


def test_wandb_runs_at_its_first_use_not_when_megatron_core_imports():
    """megatron-core imports wandb as it loads, to set a flag: about 0.9 s of every process's
    start. With ``mcore_wandb_import`` it runs at its first use (as ``--wandb-project`` makes),
    into the very module megatron-core holds; a process that never logs to W&B never runs it."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("wandb") is None:
        pytest.skip("wandb is not installed in this leg: megatron-core's import finds nothing to run")

    def flags(mode):
        done = subprocess.run([sys.executable, "-W", "ignore", "-c", _WANDB_AT_IMPORT, mode],
                              capture_output=True, text=True, timeout=120,
                              cwd=Path(__file__).resolve().parents[1])
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.split()

    assert flags("unpatched") == ["True", "True", "True", "True", "True", "True", "False"]
    assert flags("patched") == ["False", "True", "True", "True", "True", "True", "False"]
    assert mcore_wandb_import.apply() is False  # nothing to change after import


def test_the_installed_release_gets_its_patches():
    """On each CI leg: the release is a supported one, and the patches on are those declaring it
    (0.19.2 defines moe_utils.te_general_gemm itself; the rest apply to both)."""
    release = installed_mcore()  # megatron.core.__version__ may carry a "+<git hash>" of the cwd
    assert release in SUPPORTED_MCORE
    off = {"0.16.1": set(), "0.19.2": {mcore_moe_utils}}[release]
    assert set(patches.active_patches()) == set(ALL_PATCHES) - off
    assert patches.active_patches("0.16.1") == ALL_PATCHES


def test_apply_is_idempotent(megatron_world):
    assert patches.apply_patches() == patches.apply_patches()


@cpu_only
def test_global_memory_buffer(megatron_world):
    from megatron.core.utils import GlobalMemoryBuffer

    with without(mcore_utils), pytest.raises(CUDA_MISSING):
        GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "t")
    buf = GlobalMemoryBuffer()
    t = buf.get_tensor((2, 3), torch.float32, "t")
    assert t.shape == (2, 3) and t.device.type == "cpu"
    assert buf.get_tensor((3,), torch.float32, "t").data_ptr() == t.data_ptr()  # reused


@cpu_only
def test_rng_tracker(megatron_world):
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    with without(mcore_tensor_parallel_random), pytest.raises(CUDA_MISSING):
        CudaRNGStatesTracker().add("x", 11)
    draws = []
    for _ in range(2):
        tracker = CudaRNGStatesTracker()
        tracker.add("x", 11)
        torch.manual_seed(5)
        with tracker.fork("x"):
            draws.append(torch.randn(4))
        after = torch.randn(2)
        torch.manual_seed(5)
        assert_close(after, torch.randn(2), msg="fork must restore the outer RNG state")
    assert_close(draws[0], draws[1])
    torch.manual_seed(11)
    assert_close(draws[0], torch.randn(4), msg="the forked state is seeded with the tracker seed")


@cpu_only
def test_te_general_gemm_missing(megatron_world):
    from megatron.core.transformer.moe.moe_utils import router_gating_linear

    x, w = torch.randn(5, 8), torch.randn(4, 8)
    with without(mcore_moe_utils):
        if patches.applies(mcore_moe_utils):  # 0.16.1: NameError without TE
            with pytest.raises(NameError, match="te_general_gemm"):
                router_gating_linear(x, w, None, torch.float32)
        else:  # 0.19.2: unneeded, upstream runs as it is
            assert_close(router_gating_linear(x, w, None, torch.float32), x @ w.t())
    assert_close(router_gating_linear(x, w, None, torch.float32), x @ w.t())


@cpu_only
def test_router_gating(megatron_world):
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter

    tc = make_transformer_config(d_model=8, num_experts=4, top_k=2)
    router = TopKRouter(config=tc, pg_collection=get_default_pg_collection())
    x = torch.randn(3, 8)
    with without(mcore_moe_router), pytest.raises(CUDA_MISSING):
        router.gating(x)
    assert_close(router.gating(x), x @ router.weight.t())


@cpu_only
def test_alltoall_dispatcher(megatron_world):
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    tc = make_transformer_config(d_model=8, num_experts=4, top_k=1)
    pgc = get_default_pg_collection()
    with without(mcore_moe_token_dispatcher), pytest.raises(CUDA_MISSING):
        MoEAlltoAllTokenDispatcher(4, [0, 1, 2, 3], config=tc, pg_collection=pgc)
    disp = MoEAlltoAllTokenDispatcher(4, [0, 1, 2, 3], config=tc, pg_collection=pgc)
    x = torch.randn(6, 1, 8)
    routing = torch.zeros(6, 4, dtype=torch.bool)
    routing[torch.arange(6), torch.tensor([2, 0, 3, 2, 1, 0])] = True
    probs = routing.float()
    h, p = disp.dispatch_preprocess(x, routing, probs)
    h, p = disp.token_dispatch(h, p)
    h, counts, p = disp.dispatch_postprocess(h, p)
    assert counts.tolist() == [2, 1, 2, 1]
    out = disp.combine_postprocess(disp.token_combine(disp.combine_preprocess(h)))
    assert_close(out, x, msg="dispatch then combine is the identity at top-1")


@cpu_only
def test_rotary_embedding(megatron_world):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)
    with without(mcore_rotary_pos_embedding), pytest.raises(CUDA_MISSING):
        rope.get_emb(5)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    freqs = torch.outer(torch.arange(5, dtype=torch.float32), inv_freq)
    assert_close(rope.get_emb(5)[:, 0, 0], torch.cat([freqs, freqs], dim=-1))


@cpu_only
def test_default_causal_mask(megatron_world):
    from megatron.core.fusions import fused_softmax

    with without(mcore_transformer_utils), pytest.raises(CUDA_MISSING):
        fused_softmax.get_default_causal_mask(3)
    expected = torch.tensor([[False, True, True], [False, False, True], [False, False, False]])
    torch.testing.assert_close(fused_softmax.get_default_causal_mask(3), expected, rtol=0, atol=0)


def _save_tiny(path):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    path.mkdir(parents=True, exist_ok=True)
    t = torch.arange(6.0).reshape(2, 3)
    dist_checkpointing.save({"t": ShardedTensor.from_rank_offsets("t", t)}, str(path))
    loaded = dist_checkpointing.load({"t": ShardedTensor.from_rank_offsets("t", torch.zeros(2, 3))},
                                     str(path))
    assert_close(loaded["t"], t)


@cpu_only
@pytest.mark.parametrize("patch", [mcore_dist_ckpt_filesystem_async, mcore_dist_ckpt_state_dict_saver])
def test_dist_checkpoint_save(megatron_world, tmp_path, patch):
    with without(patch), pytest.raises(CUDA_MISSING):
        _save_tiny(tmp_path / "unpatched")
    _save_tiny(tmp_path / "patched")


def test_checkpoint_writers_hash_what_they_write(megatron_world, tmp_path, monkeypatch):
    """megatron-core's writers hash each data file as they write it (forked children in 0.16.1,
    threads in 0.19.2): unpatched, a save leaves no digest record and the manifest reads every
    data file back; patched, each .distcp has a record equal to its sha256, the manifest reads
    none of them, and its digests are those of a re-read."""
    from aoe_megatron.checkpoint import integrity
    from aoe_megatron.runtime import hashing

    with without(mcore_dist_ckpt_write_digests):
        _save_tiny(tmp_path / "unpatched")
    assert list((tmp_path / "unpatched").glob("*.distcp"))
    assert not list((tmp_path / "unpatched").glob("*" + hashing.RECORD_SUFFIX))
    root = tmp_path / "patched"
    _save_tiny(root)
    data = sorted(root.glob("*.distcp"))
    assert data and all(hashing.recorded_sha256(p) == hashing.sha256_file(p) for p in data)
    read = []
    monkeypatch.setattr(integrity, "sha256_file",
                        lambda p: read.append(Path(p).name) or hashing.sha256_file(p))
    manifest = integrity.write_manifest(root)
    assert read and not [n for n in read if n.endswith(".distcp")], read
    for name, entry in manifest["files"].items():
        assert entry["sha256"] == hashing.sha256_file(root / name), name
    assert not list(root.rglob("*" + hashing.RECORD_SUFFIX))


def _mappings_on_two_ranks(rank, world_size):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import mappings

    group = parallel_state.get_expert_model_parallel_group()
    sizes = [2, 3]
    x = torch.full((sizes[rank], 3), float(rank + 1))
    with without(mcore_tensor_parallel_mappings):
        for call in (
            lambda: mappings.gather_from_sequence_parallel_region(x, group=group,
                                                                  output_split_sizes=sizes),
            lambda: mappings.all_to_all(group, x, [1, 1] if rank == 0 else [2, 1],
                                        [1, 1] if rank == 0 else [1, 2]),
        ):
            with pytest.raises(CUDA_MISSING):
                call()
    gathered = mappings.gather_from_sequence_parallel_region(x, group=group, output_split_sizes=sizes)
    assert_close(gathered, torch.cat([torch.full((2, 3), 1.0), torch.full((3, 3), 2.0)]))
    even = mappings.gather_from_sequence_parallel_region(torch.full((2, 3), float(rank)), group=group)
    assert_close(even, torch.cat([torch.zeros(2, 3), torch.ones(2, 3)]))
    y = torch.arange(8.0).reshape(4, 2) * (rank + 1)
    scattered = mappings.reduce_scatter_to_sequence_parallel_region(y, group=group)
    assert_close(scattered, (torch.arange(8.0).reshape(4, 2) * 3)[2 * rank : 2 * rank + 2])
    # Uneven all-to-all: rank 0 sends 1 row to each; rank 1 sends 2 rows to rank 0, 1 to itself.
    send = [1, 1] if rank == 0 else [2, 1]
    recv = [1, 2] if rank == 0 else [1, 1]
    rows = torch.arange(float(sum(send))).unsqueeze(1) + 10 * rank
    got = mappings.all_to_all(group, rows, recv, send)
    expected = torch.tensor([[0.0], [10.0], [11.0]]) if rank == 0 else torch.tensor([[1.0], [12.0]])
    assert_close(got, expected)


@pytest.mark.distributed
@cpu_only
def test_tensor_parallel_mappings_on_gloo():
    run_distributed(_mappings_on_two_ranks, 2)



_RANK_THEN_SIGKILL = """
import os, signal, sys
from multiprocessing import resource_tracker
from aoe_megatron.patches import mcore_dist_ckpt_results_queue as patch
from megatron.core.dist_checkpointing.strategies import filesystem_async
if sys.argv[1] == "patched":
    patch.apply()
queue = getattr(filesystem_async, patch.upstream_name())()
print(queue._manager._process.pid, resource_tracker._resource_tracker._pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["unpatched", "patched"])
def test_the_checkpoint_writers_manager_dies_with_its_rank(mode, tmp_path):
    """A rank SIGKILLed after megatron started its results-queue Manager (spawn context): with
    the patch the Manager and its resource tracker are gone within seconds; without it, both
    are left behind as orphans."""
    import subprocess
    import sys
    import time

    out, err = tmp_path / "out", tmp_path / "err"
    with open(out, "w") as stdout, open(err, "w") as stderr:  # files: an orphan holds no pipe open
        proc = subprocess.run([sys.executable, "-c", _RANK_THEN_SIGKILL, mode], stdout=stdout,
                              stderr=stderr, timeout=120)
    assert proc.returncode == -9, err.read_text()[-3000:]
    helpers = [int(x) for x in out.read_text().split()]
    assert len(helpers) == 2, out.read_text()
    deadline = time.monotonic() + (10 if mode == "patched" else 2)
    while any(map(_alive, helpers)) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in helpers if _alive(pid)]
    try:
        if mode == "patched":
            assert not left, f"left behind: {left}"
        else:
            assert left == helpers, "the unpatched Manager died anyway: is the patch still needed?"
    finally:
        for pid in left:
            os.kill(pid, 9)
