"""runtime/spawn.py, the one spawner of the tests' gloo worlds, the EP benchmark and the
benchmark's memory phase: results by rank, every failed rank reported, a hung one killed."""

from __future__ import annotations

import os
import time

import pytest

from aoe_megatron.runtime.spawn import SpawnFailed, spawn


def _identify(rank, offset):
    return {"rank": rank, "env": [os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")],
            "value": rank + offset}


def _rank_one_fails(rank):
    if rank == 1:
        raise ValueError("rank one's own error")
    return rank


def _rank_zero_hangs(rank):
    if rank == 0:
        time.sleep(60)
    return rank


def _exits_without_result(rank):
    os._exit(3)


def _slow_to_exit(rank):
    """Its result at once; its exit 7 s later (a non-daemon thread, as a checkpoint writer's)."""
    import threading

    threading.Thread(target=time.sleep, args=(7,)).start()
    return rank


@pytest.mark.distributed
def test_results_come_back_by_rank_with_the_rendezvous_set():
    out = spawn(_identify, 3, 10, timeout=120)
    assert [r["value"] for r in out] == [10, 11, 12]
    assert [r["env"] for r in out] == [[str(r), str(r), "3"] for r in range(3)]


@pytest.mark.distributed
@pytest.mark.waits
def test_a_rank_slow_to_exit_after_its_result_is_waited_for():
    started = time.monotonic()
    assert spawn(_slow_to_exit, 1, timeout=60) == [0]
    assert time.monotonic() - started >= 7


@pytest.mark.distributed
@pytest.mark.waits
def test_each_failed_hung_or_silent_rank_is_named():
    with pytest.raises(SpawnFailed, match=r"(?s)1 of 2 ranks failed.*rank 1 of 2.*ValueError: rank one's own error"):
        spawn(_rank_one_fails, 2, timeout=120, what="ranks")
    started = time.monotonic()
    with pytest.raises(SpawnFailed, match=r"rank 0 of 2:\nstill running after 5 s: killed"):
        spawn(_rank_zero_hangs, 2, timeout=5, what="ranks")
    assert time.monotonic() - started < 30
    with pytest.raises(SpawnFailed, match=r"exited with code 3 and no result"):
        spawn(_exits_without_result, 1, timeout=60, rendezvous=False)
