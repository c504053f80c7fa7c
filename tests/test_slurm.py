"""run/slurm/pretrain.sbatch on a real (local, two-node) Slurm cluster: tiny preset, EP=2 across
the two nodes, a few steps, and the job completes."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NEEDED = ("slurmctld", "slurmd", "sbatch", "munged", "mungekey", "runuser")

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t) for t in NEEDED),
    reason="needs root and Debian's slurmctld slurmd slurm-client munge (`make test` installs them)",
)


def _free_port_block(n: int = 3) -> int:
    for _ in range(50):
        base = 20000 + (os.getpid() * 7 + int(time.time() * 1000)) % 20000
        try:
            socks = []
            for p in range(base, base + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            for s in socks:
                s.close()
            return base
        except OSError:
            time.sleep(0.01)
    raise RuntimeError("no free port block")


@pytest.fixture
def cluster():
    import tempfile

    # NOTE: not under pytest's tmp_path (mode 700): the munge user must reach its socket.
    state = Path(tempfile.mkdtemp(prefix="aoe-slurm-"))
    state.chmod(0o755)
    env = {**os.environ, "SLURM_TEST_PORT_BASE": str(_free_port_block())}
    script = ROOT / "tests" / "slurm" / "local_cluster.sh"
    up = subprocess.run([str(script), "up", str(state)], capture_output=True, text=True, env=env,
                        timeout=180)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield {**os.environ, "SLURM_CONF": up.stdout.strip().splitlines()[-1]}
    finally:
        subprocess.run([str(script), "down", str(state)], timeout=60)
        shutil.rmtree(state, ignore_errors=True)


def _job_state(env, job_id: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, env=env)
    match = re.search(r"JobState=(\w+)", out.stdout)
    return match.group(1) if match else "UNKNOWN"


def test_sbatch_template_trains_across_two_nodes(cluster, tmp_path):
    from aoe_megatron.data.assets import CORPUS
    from aoe_megatron.data.preprocess import PreprocessConfig, preprocess

    src = tmp_path / "corpus.jsonl"
    src.write_text("\n".join(CORPUS.read_text(encoding="utf-8").splitlines()[:200]) + "\n")
    prefix = next(iter(preprocess(PreprocessConfig(
        inputs=(str(src),), output_prefix=str(tmp_path / "data"), append_eod=True, workers=0,
        log_interval=1e9))))
    data = tmp_path / "data.yaml"
    data.write_text(f"blend:\n  - {{prefix: {prefix}, weight: 1}}\nsplit: '90,10,0'\n")
    from aoe_megatron.distributed import free_port

    env = {**cluster, "NODES": "2", "GPUS_PER_NODE": "1", "PRESET": "tiny", "DATA": str(data),
           "EP": "2", "ZERO": "1", "TRAIN_STEPS": "4", "RUN_DIR": str(tmp_path / "run"),
           "CKPT_DIR": str(tmp_path / "ckpt"), "MASTER_PORT": str(free_port()),
           "VENV": sys.prefix, "EXTRA_ARGS": "--eval-interval 2 --eval-iters 2"}
    log = tmp_path / "job.out"
    sub = subprocess.run(["sbatch", "--nodes=2", f"--output={log}", "run/slurm/pretrain.sbatch"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.split()[-1]
    deadline = time.monotonic() + 600
    state = "PENDING"
    while time.monotonic() < deadline:
        state = _job_state(env, job_id)
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            break
        time.sleep(2)
    output = log.read_text() if log.exists() else ""
    assert state == "COMPLETED", f"job {job_id} ended {state}:\n{output[-4000:]}"
    assert "on 2 node(s) x 1" in output and "training finished" in output, output[-4000:]
    finished = json.loads((tmp_path / "run" / "finished.json").read_text())
    assert finished["steps"] == 4 and finished["final_valid_loss"] is not None
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_00000004"
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["world_size"] == 2
