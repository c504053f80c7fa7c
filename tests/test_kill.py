"""Fault 4a (issue #13): one rank SIGKILLed mid-step, with no chance to save. The job fails fast,
and the same command resumes from the last complete checkpoint and reproduces the uninterrupted
run's losses exactly."""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from aoe_megatron.runtime import launch

ROOT = Path(__file__).resolve().parents[1]

# NOTE: torchrun SIGTERMs the survivors as soon as a worker dies and SIGKILLs them 30 s later
# (its --shutdown-timeout), so a survivor stuck anywhere ends the job in about 30 s; one that
# notices the dead peer itself exits in about 2 s (gloo: "Connection reset by peer").
SURVIVOR_NOTICES_WITHIN_S = 25
FORCED_BY_TORCHRUN = "forcefully exiting via"  # torchrun's words when SIGTERM did not end a worker


def _workers(torchrun_pid: int) -> dict:
    """{rank: pid} of torchrun's worker processes."""
    children = Path(f"/proc/{torchrun_pid}/task/{torchrun_pid}/children").read_text().split()
    ranks = {}
    for pid in map(int, children):
        env = dict(e.split("=", 1) for e in
                   Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in e)
        if "RANK" in env:
            ranks[int(env["RANK"])] = pid
    return ranks


def _tagged(token: str) -> list:
    """Live processes this test started (their environment holds ``token``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            tagged = f"AOE_TEST_KILL={token}\0" in (entry / "environ").read_text()
            state = (entry / "status").read_text().split("State:")[1].split()[0]
        except (OSError, IndexError):  # gone, or not ours
            continue
        if tagged and state != "Z":
            found.append(int(entry.name))
    return found


def _kill_tagged(token: str) -> None:
    """SIGKILL whatever is left of the processes this test started (a failed test's)."""
    for pid in _tagged(token):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _nothing_left(token: str, within_s: float = 10.0) -> list:
    """The test's processes still alive ``within_s`` seconds after its job ended (none: the
    checkpoint writer's helpers die with their rank, patches/mcore_dist_ckpt_results_queue.py)."""
    deadline = time.monotonic() + within_s
    while (left := _tagged(token)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [(pid, Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:120])
            for pid in left if Path(f"/proc/{pid}").exists()]


def _log_until(path: Path, proc, phrase: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while phrase not in path.read_text():
        assert proc.poll() is None, path.read_text()
        assert time.monotonic() < deadline, f"the run never logged {phrase!r}"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.distributed
def test_sigkill_of_one_rank_fails_fast_and_the_restart_matches_the_uninterrupted_run(
        tiny_reference_run, tmp_path):
    token = uuid.uuid4().hex
    env = {"AOE_TEST_KILL": token}
    reference = tiny_reference_run["losses"]

    ckpt_dir = tmp_path / "ck"
    args = [*tiny_reference_run["args"], "--ckpt-dir", ckpt_dir, "--run-dir", tmp_path / "run"]
    first = tmp_path / "first.log"
    try:
        with open(first, "w") as log:
            # launch.start, not launch.run: the test needs torchrun's PID to find the workers.
            proc = launch.start(args, nproc=2, env=env, cwd=ROOT, stdout=log)
            # Step 5 is logged after the checkpoint of step 4: the ranks are in step 6 now.
            _log_until(first, proc, "step       5/8", timeout=300)
            # NOTE: rank 1, so that the survivor is rank 0, the rank that renames a finished
            # checkpoint and points `latest` at it: it must fail, not finish a save alone.
            victim = _workers(proc.pid)[1]
            os.kill(victim, signal.SIGKILL)
            killed_at = time.monotonic()
            proc.wait(timeout=120)
            exit_s = time.monotonic() - killed_at
        left = _nothing_left(token)
    finally:
        if proc.poll() is None:
            proc.kill()
        _kill_tagged(token)
    assert not left, f"processes of the killed job outlived it: {left}"
    text = first.read_text()
    assert proc.returncode != 0, text
    assert f"Signal 9 (SIGKILL) received by PID {victim}" in text, text
    assert FORCED_BY_TORCHRUN not in text, f"the survivor did not notice the dead rank:\n{text}"
    assert exit_s < SURVIVOR_NOTICES_WITHIN_S, f"torchrun took {exit_s:.1f}s to exit:\n{text}"

    # `latest` names a complete checkpoint, never a half-written one.
    named = (ckpt_dir / "latest").read_text().strip()
    assert ".partial" not in named and (ckpt_dir / named / "state.json").is_file(), named
    resumed_from = int(named.split("_")[1])
    assert resumed_from in (4, 6), named  # 6 only if the save of step 6 was complete by then

    try:
        resumed = launch.run(args, nproc=2, env=env, cwd=ROOT, timeout=600,
                             summary=tmp_path / "resumed.json")
    finally:
        _kill_tagged(token)
    out = resumed.output
    assert resumed.returncode == 0, out
    assert f"resumed from {ckpt_dir / named} at step {resumed_from}" in out, out
    summary = resumed.summary()
    assert summary["start"] == resumed_from
    after = summary["losses"]
    assert sorted(after) == list(range(resumed_from + 1, 9))
    # Same layout, same data, CPU: the resumed run is bit-identical to the uninterrupted one.
    assert after == {step: reference[step] for step in after}, (after, reference)


def _sleep_forever():
    time.sleep(600)


def _fork_then_die(rank, port, pids):
    """Rank 0 forks a child (as megatron-core's checkpoint writer does) and is SIGKILLed; rank 1
    then waits in a barrier for it."""
    import torch.distributed as dist

    from aoe_megatron.runtime.distributed import init_megatron

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE="2")
    init_megatron(rank=rank, world_size=2, expert_parallel_size=1, timeout_minutes=1)
    dist.barrier()
    if rank == 0:
        child = mp.get_context("fork").Process(target=_sleep_forever)
        child.start()
        pids.put(child.pid)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        dist.barrier()
        pids.put(("returned", time.monotonic() - start))
    except RuntimeError:
        pids.put(("raised", time.monotonic() - start))


@pytest.mark.distributed  # two spawned ranks, about 6 s
def test_a_rank_killed_with_a_forked_child_alive_is_still_seen_to_die():
    # Without the parent-death signal the child keeps rank 0's sockets open: rank 1 waits the
    # whole timeout (a minute here) and the child lives on.
    from aoe_megatron.runtime.distributed import free_port

    ctx = mp.get_context("spawn")
    pids = ctx.SimpleQueue()
    port = free_port()  # two ranks spawned here, not a launch: they need a rendezvous port
    procs = [ctx.Process(target=_fork_then_die, args=(r, port, pids)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank hung"
    child = pids.get()
    outcome, waited = pids.get()
    time.sleep(0.5)  # the child's SIGKILL and its reaping by init
    stat = Path(f"/proc/{child}/stat")
    child_alive = stat.exists() and stat.read_text().split()[2] != "Z"  # Z: dead, not yet reaped
    if child_alive:
        os.kill(child, signal.SIGKILL)
    assert outcome == "raised" and waited < 10, (outcome, waited)
    assert not child_alive, "the forked child outlived its rank"


def test_the_collective_timeout_is_a_positive_setting(capsys):
    from aoe_megatron.train.flags import parse_train_args
    from aoe_megatron.train.loop import main

    cfg = parse_train_args(["--preset", "tiny", "--train-iters", "1",
                            "--distributed-timeout-minutes", "0.5"])
    assert cfg.distributed_timeout_minutes == 0.5
    assert main(["--preset", "tiny", "--train-iters", "2", "--mock-data",
                 "--distributed-timeout-minutes", "0"]) == 2
    assert "--distributed-timeout-minutes must be positive" in capsys.readouterr().err
