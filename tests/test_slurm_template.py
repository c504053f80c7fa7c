"""run/slurm/pretrain.sbatch's start-up checks, without Slurm: the template runs under plain bash
with a fake `srun` that records how it was called. A job without the GPUs it asks for refuses to
start (rather than train on CPU), DEVICE=cpu is a CPU run with the GPUs hidden, and the one task
per node gets the job's CPUs, or the job refuses when it holds fewer CPUs than processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV_MARK = "[srun env] CUDA_VISIBLE_DEVICES="


def _run_template(tmp_path, cwd=ROOT, **settings: str) -> tuple[subprocess.CompletedProcess, list]:
    """Run the template with two processes per node, submitted from ``cwd``; ``settings``
    override the environment. Returns the finished process and one list per srun call: its
    arguments, then its CUDA_VISIBLE_DEVICES ("<unset>" when not set)."""
    bin_dir, log = tmp_path / "bin", tmp_path / "srun.log"
    bin_dir.mkdir(exist_ok=True)
    srun = bin_dir / "srun"
    srun.write_text(f"""#!/bin/sh
printf '%s\\n' "$@" >> '{log}'
echo "{ENV_MARK}${{CUDA_VISIBLE_DEVICES-<unset>}}" >> '{log}'
""")
    srun.chmod(0o755)
    env = {  # not os.environ: no SLURM_*, DEVICE or CUDA_VISIBLE_DEVICES from outside
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HOME": str(tmp_path),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "NODES": "1", "GPUS_PER_NODE": "2",
        "VENV": sys.prefix, "SLURM_CPUS_ON_NODE": "4", "RUN_DIR": str(tmp_path / "run"),
        "CKPT_DIR": str(tmp_path / "ckpt"), "REQUEUE": "0", "PRESET": "tiny", **settings}
    proc = subprocess.run(["bash", str(ROOT / "run/slurm/pretrain.sbatch")], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)
    calls, current = [], []
    for line in (log.read_text().splitlines() if log.exists() else []):
        if line.startswith(ENV_MARK):
            calls.append(current + [line[len(ENV_MARK):]])
            current = []
        else:
            current.append(line)
    return proc, calls


def test_cuda_mode_without_gpus_refuses_to_start(tmp_path):
    # What Slurm sets for a job that asked for no GPUs: none visible (as with this CPU torch).
    proc, calls = _run_template(tmp_path, CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "sees 0 GPU(s)" in proc.stderr and "GPUS_PER_NODE=2" in proc.stderr, proc.stderr
    assert "--gpus-per-node=2" in proc.stderr and "DEVICE=cpu" in proc.stderr, proc.stderr
    assert calls == [], "srun ran although the job has no GPUs"


def test_cpu_mode_hides_gpus_and_gives_the_task_the_nodes_cpus(tmp_path):
    proc, calls = _run_template(tmp_path, DEVICE="cpu", SLURM_CPUS_ON_NODE="6",
                                CUDA_VISIBLE_DEVICES="0,1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(calls) == 1, calls
    args, visible = calls[0][:-1], calls[0][-1]
    assert "--cpus-per-task=6" in args, args
    nproc = args.index("--nproc_per_node")
    assert args[nproc + 1] == "2", args
    assert visible == "", "srun's environment still shows GPUs"
    # slurmstepd may overwrite the exported value on GPU nodes: the launcher empties it too.
    python = args.index(f"{sys.prefix}/bin/python")
    assert args[python - 2:python] == ["env", "CUDA_VISIBLE_DEVICES="], args
    assert "on 1 node(s) x 2 (cpu" in proc.stdout and "6 CPUs per node" in proc.stdout, proc.stdout


def test_the_stop_window_follows_what_torchrun_can_do(tmp_path):
    """torch 2.13's torchrun takes --shutdown-timeout; torch 2.11's (the 0.19.2 leg's, NeMo-style
    containers) has none and would refuse the flag: the template leaves it out, says the window
    is torchrun's fixed 30 s (what the ranks then compare a save with)."""
    proc, calls = _run_template(tmp_path, DEVICE="cpu", SHUTDOWN_TIMEOUT="300")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    args = calls[0][:-1]
    assert args[args.index("--shutdown-timeout") + 1] == "300", args
    assert "no --shutdown-timeout" not in proc.stderr

    old = tmp_path / "old-torch"  # a virtualenv whose torch's torchrun lacks the flag
    (old / "bin").mkdir(parents=True)
    (old / "site" / "torch" / "distributed").mkdir(parents=True)
    (old / "site" / "torch" / "__init__.py").write_text("")
    (old / "site" / "torch" / "distributed" / "run.py").write_text(
        'parser.add_argument("--nproc-per-node")\n')
    python = old / "bin" / "python"
    python.write_text(f"""#!/bin/sh
PYTHONPATH='{old / "site"}' exec '{sys.executable}' "$@"
""")
    python.chmod(0o755)
    proc, calls = _run_template(tmp_path, DEVICE="cpu", SHUTDOWN_TIMEOUT="300", VENV=str(old))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    args = calls[-1][:-1]
    assert "--shutdown-timeout" not in args, args
    assert "has no --shutdown-timeout" in proc.stderr and "within 30 s" in proc.stderr, proc.stderr


def test_fewer_cpus_than_processes_refuses_to_start(tmp_path):
    proc, calls = _run_template(tmp_path, DEVICE="cpu", SLURM_CPUS_ON_NODE="1")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "1 CPU(s)" in proc.stderr and "GPUS_PER_NODE=2" in proc.stderr, proc.stderr
    assert "--cpus-per-task" in proc.stderr and "--exclusive" in proc.stderr, proc.stderr
    assert calls == [], "srun ran with fewer CPUs than processes"


def test_unknown_device_refuses_to_start(tmp_path):
    proc, calls = _run_template(tmp_path, DEVICE="bogus")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "DEVICE=bogus" in proc.stderr, proc.stderr
    assert calls == []


def test_a_folder_held_by_a_live_launch_is_waited_for_then_refused(tmp_path):
    """A requeued job waits for its predecessor's lease (train/lock.py), up to the lease
    timeout; still held after that, the job does not start. A dead holder's lease is no hold."""
    hold = ("import sys, time\nfrom aoe_megatron.train.lock import FolderLock\n"
            "FolderLock(sys.argv[1]).acquire()\nprint('held', flush=True)\ntime.sleep(600)\n")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path / "ckpt")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        proc, calls = _run_template(tmp_path, DEVICE="cpu", AOE_LEASE_TIMEOUT_S="1",
                                    AOE_LEASE_HEARTBEAT_S="0.5")
        assert proc.returncode == 2 and calls == [], proc.stdout + proc.stderr
        assert f"{tmp_path / 'ckpt'} is held by host" in proc.stderr
        assert f"pid {holder.pid}" in proc.stderr and "not starting" in proc.stderr
    finally:
        holder.kill()
        holder.wait()
    proc, calls = _run_template(tmp_path, DEVICE="cpu")  # its lease is left, its holder gone
    assert proc.returncode == 0 and len(calls) == 1, proc.stdout + proc.stderr


def test_from_an_install_it_runs_the_python_behind_aoe_train(tmp_path):
    """No checkout (no .venv where it is submitted), no VENV: the Python beside the aoe-train on
    PATH runs, or the one its #! line names; the data config is the package's copy. Without
    any of them the job refuses to start, saying what to set (issue #36)."""
    work, install = tmp_path / "work", tmp_path / "install"
    work.mkdir()
    (install / "bin").mkdir(parents=True)
    python = install / "bin" / "python"  # a virtualenv's python, as a wrapper of this one
    python.write_text(f"#!/bin/sh\nexec '{sys.executable}' \"$@\"\n")
    python.chmod(0o755)
    (install / "bin" / "aoe-train").write_text(f"#!{python}\n")
    path = f"{tmp_path / 'bin'}{os.pathsep}{install / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin"
    proc, calls = _run_template(tmp_path, cwd=work, DEVICE="cpu", VENV="", PATH=path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    args = calls[0][:-1]
    assert args[args.index(str(python)) + 1:][:2] == ["-m", "torch.distributed.run"], args
    assert args[args.index("--data-path") + 1] == "data-redpajama.yaml", args

    (tmp_path / "user" / "bin").mkdir(parents=True)  # pip install --user: no python beside it
    (tmp_path / "user" / "bin" / "aoe-train").write_text(f"#!{python} -E\n")
    path = f"{tmp_path / 'bin'}{os.pathsep}{tmp_path / 'user' / 'bin'}{os.pathsep}/usr/bin"
    proc, calls = _run_template(tmp_path, cwd=work, DEVICE="cpu", VENV="", PATH=path + ":/bin")
    assert proc.returncode == 0 and str(python) in calls[-1], proc.stdout + proc.stderr

    proc, calls = _run_template(tmp_path, cwd=work, DEVICE="cpu", VENV="",
                                PATH=f"{tmp_path / 'bin'}{os.pathsep}/usr/bin{os.pathsep}/bin")
    assert proc.returncode == 2 and len(calls) == 2, proc.stdout + proc.stderr
    assert "no Python with aoe-megatron installed" in proc.stderr, proc.stderr
    assert "VENV=/path/to/venv or PYTHON=/path/to/python" in proc.stderr, proc.stderr
