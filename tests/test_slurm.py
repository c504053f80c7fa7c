"""run/slurm/pretrain.sbatch on a real (local, two-node) Slurm cluster: tiny preset, EP=2 across
the two nodes. A job whose time limit comes mid-run is warned by Slurm (SIGTERM), saves, requeues
itself, resumes and finishes with the losses of an uninterrupted run."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NEEDED = ("slurmctld", "slurmd", "sbatch", "munged", "mungekey", "runuser")

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.slow,
    pytest.mark.distributed,
    pytest.mark.skipif(
        os.geteuid() != 0 or not all(shutil.which(t) for t in NEEDED),
        reason="needs root and Debian's slurmctld slurmd slurm-client munge (`make test` installs them)",
    ),
]


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


ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def _small_corpus(tmp_path) -> Path:
    """A data config over 200 documents of the demo corpus, preprocessed."""
    from aoe_megatron.data.assets import CORPUS
    from aoe_megatron.data.preprocess import PreprocessConfig, preprocess

    src = tmp_path / "corpus.jsonl"
    src.write_text("\n".join(CORPUS.read_text(encoding="utf-8").splitlines()[:200]) + "\n")
    prefix = next(iter(preprocess(PreprocessConfig(
        inputs=(str(src),), output_prefix=str(tmp_path / "data"), append_eod=True, workers=0,
        log_interval=1e9))))
    data = tmp_path / "data.yaml"
    data.write_text(f"blend:\n  - {{prefix: {prefix}, weight: 1}}\nsplit: '90,10,0'\n")
    return data


def _template_env(cluster, tmp_path, data, *, steps: int, extra: str) -> dict:
    """The template's settings: two nodes x one process, tiny preset, EP=2; DEVICE=cpu, as the
    local cluster has no GPUs (the one CPU per node Slurm gives the job covers the one process)."""
    from aoe_megatron.runtime.distributed import free_port

    return {**cluster, "NODES": "2", "GPUS_PER_NODE": "1", "DEVICE": "cpu", "PRESET": "tiny",
            "DATA": str(data), "EP": "2", "ZERO": "1", "TRAIN_STEPS": str(steps),
            "RUN_DIR": str(tmp_path / "run"), "CKPT_DIR": str(tmp_path / "ckpt"),
            "MASTER_PORT": str(free_port()), "VENV": sys.prefix, "EXTRA_ARGS": extra}


def _sbatch(env, log: Path, *options: str) -> str:
    sub = subprocess.run(["sbatch", "--nodes=2", f"--output={log}", *options,
                          "run/slurm/pretrain.sbatch"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    return sub.stdout.split()[-1]


def _wait_until_ended(env, job_id: str, timeout: float, tick=None) -> str:
    """Poll the job until it ends (or ``timeout`` s); ``tick()`` runs on every poll."""
    deadline = time.monotonic() + timeout
    state = "PENDING"
    while time.monotonic() < deadline:
        state = _job_state(env, job_id)
        if state in ENDED:
            break
        if tick is not None:
            tick()
        time.sleep(1)
    return state


# The time-limit test runs the template as written (--signal=TERM@120, Slurm's warning 120 s before
# the time limit) under a 10-minute limit. slurmctld checks time limits every 30 s (a constant in
# Slurm). Once the run is mid-way, the test shortens the limit (scontrol update TimeLimit) so that
# the warning is due: it goes out at the next check, within 30 s, and the limit itself stays at
# least 60 s away, time to save and exit. Seen the warning, the test gives the job its 10 minutes
# back, so the restarted job finishes unwarned.
LIMIT_MIN, WARN_S, CHECK_S = 10, 120, 30


def _start_time(env, job_id: str, timeout: float = 120) -> float:
    """Wait until the job runs; its start (epoch seconds, Slurm's whole-second StartTime)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True,
                             env=env).stdout
        if "JobState=RUNNING" in out:
            stamp = re.search(r"StartTime=(\S+)", out).group(1)
            return time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%S"))
        assert not any(f"JobState={s}" in out for s in ENDED), out
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} did not start within {timeout} s")


def _train_losses(run_dir: Path) -> dict:
    """Per-step training loss from metrics.jsonl; after a resume the last line for a step wins."""
    path = run_dir / "metrics.jsonl"
    losses = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.endswith("}"):  # a line being written is skipped until complete
                record = json.loads(line)
                if record["kind"] == "train":
                    losses[record["step"]] = record["loss"]
    return losses


def _cmdline(pid) -> list:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")


def _training_pids(run_dir: Path) -> list:
    """The training processes writing to ``run_dir``: torchrun's workers, not torchrun itself nor
    the workers' own children (forked checkpoint writers share their command line)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            args = _cmdline(entry.name)
            if "aoe_megatron.train" not in args or str(run_dir) not in args:
                continue
            parent = (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
            if "torch.distributed.run" in _cmdline(parent) and "torch.distributed.run" not in args:
                pids.append(int(entry.name))
        except (OSError, IndexError):  # not a process, or it just ended
            continue
    return pids


def _signal_all(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def test_time_limit_warning_saves_requeues_and_resumes_exactly(cluster, tmp_path):
    """The template's time-limit path, for real: Slurm's warning signal reaches the run mid-run, it
    saves, the job requeues itself, restarts, resumes and finishes with every step's loss equal to
    an uninterrupted run's (plain torchrun, same settings: world size 2, EP 2).

    NOTE: the run needs only seconds, and Slurm's warning comes on a 30-s tick. So once the run
    is past step ``hold_at``, the test stops its two training processes (SIGSTOP), as if the step
    were slow, and shortens the job's limit so that the warning is due at the next tick (the
    constants above). Slurm itself wakes them: it sends SIGCONT with the warning signal. The
    warning thus lands mid-step after the trainer's handler is in place, at any machine speed, and
    the reference run trains while they wait.
    Periodic saves (every 4 steps) come before the warning: the save it asks for must still
    work although Slurm signals every process of the step (``checkpoint.start_writer``).
    """
    from aoe_megatron.runtime import launch

    steps, hold_at = 24, 8
    data = _small_corpus(tmp_path)
    env = _template_env(cluster, tmp_path, data, steps=steps,
                        extra="--eval-interval 0 --log-interval 1 --save-interval 4")
    run_dir, ckpt_dir, log = tmp_path / "run", tmp_path / "ckpt", tmp_path / "job.out"
    job_id = _sbatch(env, log, f"--time={LIMIT_MIN}")
    started = _start_time(env, job_id)
    controller = Path(env["SLURM_CONF"]).parent / "log" / "slurmctld.log"

    def warned() -> bool:
        return controller.exists() and re.search(
            rf"warning signal 15 to JobId={job_id}\b", controller.read_text()) is not None

    def set_limit(minutes: int) -> None:
        subprocess.run(["scontrol", "update", f"JobId={job_id}", f"TimeLimit={minutes}"],
                       env=env, check=True, capture_output=True, timeout=60)

    deadline = time.monotonic() + 240
    while len(_train_losses(run_dir)) < hold_at:
        assert _job_state(env, job_id) == "RUNNING", log.read_text()
        assert time.monotonic() < deadline, f"the job never reached step {hold_at}"
        time.sleep(0.2)
    held, reference, state, restored = _training_pids(run_dir), None, "RUNNING", False
    try:
        assert len(held) == 2, f"expected the job's two training processes, found {held}"
        _signal_all(held, signal.SIGSTOP)
        # the limit a whole minute count away that puts the warning (WARN_S before it) in the past
        # and the limit itself 60 s or more ahead
        limit = math.ceil((time.time() - started + 60) / 60)
        set_limit(limit)
        shortened = time.time()

        reference_dir = tmp_path / "reference"
        with open(tmp_path / "reference.out", "w") as reference_log:
            reference = launch.start(
                ["--preset", "tiny", "--data-path", data, "--expert-model-parallel-size", "2",
                 "--zero-stage", "1", "--train-iters", steps, "--eval-interval", "0",
                 "--log-interval", "1", "--save-interval", "4", "--run-dir", reference_dir],
                nproc=2, threads=1, cwd=ROOT, stdout=reference_log)

        def tick():
            nonlocal restored
            if not restored and warned():  # the restarted job gets the whole limit
                set_limit(LIMIT_MIN)
                restored = True
            if held and time.time() > shortened + CHECK_S + 15:  # never needed when Slurm
                _signal_all(held, signal.SIGCONT)                # behaves; a failure must not hang
                held.clear()

        state = _wait_until_ended(env, job_id, 420, tick=tick)
        reference.wait(timeout=300)
    finally:  # on a failure, leave nothing stopped or running behind
        _signal_all(held, signal.SIGCONT)
        if reference is not None and reference.poll() is None:
            reference.kill()
        if state not in ENDED:
            subprocess.run(["scancel", job_id], env=env, capture_output=True, timeout=60)
    output = log.read_text() if log.exists() else ""
    assert state == "COMPLETED", f"job {job_id} ended {state}:\n{output[-6000:]}"
    assert warned() and restored, "slurmctld never sent the time-limit warning:\n" + output[-6000:]

    # Warned mid-run: it saved and stopped, requeued, and the restart resumed from that step.
    stopped = re.search(r"stopped by a signal after step (\d+)", output)
    assert stopped, output[-6000:]
    stop_step = int(stopped.group(1))
    assert hold_at <= stop_step < steps, output[-6000:]
    assert f"requeueing job {job_id}" in output, output[-6000:]
    assert "(restart 1)" in output, output[-6000:]
    assert f"resumed from {ckpt_dir / f'step_{stop_step:08d}'} at step {stop_step}" in output, (
        output[-6000:])
    assert "training finished" in output, output[-6000:]
    assert "on 2 node(s) x 1" in output, output[-6000:]
    assert json.loads((run_dir / "run.json").read_text())["world_size"] == 2
    assert (ckpt_dir / "latest").read_text().strip() == f"step_{steps:08d}"
    assert json.loads((run_dir / "finished.json").read_text())["steps"] == steps
    restarts = re.search(r"Restarts=(\d+)", subprocess.run(
        ["scontrol", "show", "job", job_id], capture_output=True, text=True, env=env).stdout)
    assert restarts and int(restarts.group(1)) >= 1

    # The same settings as the reference, and the same loss at every step.
    assert reference.returncode == 0, (tmp_path / "reference.out").read_text()[-4000:]
    configs = []
    for directory in (run_dir, reference_dir):
        config = json.loads((directory / "config.json").read_text())
        for key in ("ckpt_dir", "run_dir", "save", "load"):  # folders: the job's own, by design
            config["train"].pop(key)
        configs.append(config)
    assert configs[0] == configs[1]
    resumed, uninterrupted = _train_losses(run_dir), _train_losses(reference_dir)
    assert sorted(resumed) == sorted(uninterrupted) == list(range(1, steps + 1))
    import torch

    torch.testing.assert_close(
        torch.tensor([resumed[s] for s in range(1, steps + 1)], dtype=torch.float64),
        torch.tensor([uninterrupted[s] for s in range(1, steps + 1)], dtype=torch.float64),
        rtol=1e-6, atol=1e-6, msg=lambda m: f"resumed run vs uninterrupted run: {m}")


def _holding_conf(conf: str) -> list:
    """Processes whose environment names this cluster's slurm.conf (its daemons, jobs, steps)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if f"SLURM_CONF={conf}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                found.append((int(entry.name), " ".join(_cmdline(entry.name))[:120]))
        except OSError:  # not ours to read, or it just ended
            continue
    return found


def test_down_ends_what_a_failed_test_left_running(cluster, tmp_path):
    """A test that fails mid-job leaves its job running: ``local_cluster.sh down`` ends the batch
    script, srun, slurmstepd and the tasks with the daemons (issue #24)."""
    conf = cluster["SLURM_CONF"]
    sub = subprocess.run(["sbatch", "--nodes=2", f"--output={tmp_path / 'job.out'}",
                          "--wrap", "srun sleep 600"], cwd=tmp_path, env=cluster,
                         capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    deadline = time.time() + 60
    while time.time() < deadline and not any(
            "slurm_script" in cmd for _, cmd in _holding_conf(conf)):
        time.sleep(0.2)
    time.sleep(2)  # srun starts its step
    left = _holding_conf(conf)
    assert any("slurm_script" in cmd for _, cmd in left), left  # the batch script
    assert any("slurmstepd" in cmd for _, cmd in left), left
    subprocess.run([str(ROOT / "tests" / "slurm" / "local_cluster.sh"), "down",
                    str(Path(conf).parent)], timeout=60, check=True)
    assert _holding_conf(conf) == []
