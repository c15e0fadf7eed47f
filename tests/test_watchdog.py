"""Hang detection (ray_ppu.recovery.watchdog): the decision on the ranks' progress files, the beacon's
files and stack dump, and end to end a SIGSTOPped worker (faults suite)."""

import os
import signal
import threading
import time

import pytest

from ray_ppu import checkpoint
from ray_ppu.recovery import watchdog


def rank(r, iteration, at, beat_age=0.5, state="train", world=2, step=1.0):
    return {"rank": r, "world": world, "pid": 100 + r, "node": "n", "group_started": 0.0,
            "iteration": iteration, "state": state, "time": at, "step_s": step,
            "beat_age_s": beat_age}


def test_no_decision_before_every_rank_has_completed_an_iteration():
    assert watchdog.hang_cause([rank(0, 3, 0.0)], 10, 0, now=1e6) is None  # rank 1 missing
    assert watchdog.hang_cause([rank(0, 3, 0.0), rank(1, None, 0.0)], 10, 0, now=1e6) is None


def test_a_frozen_rank_is_named_after_the_timeout():
    ranks = [rank(0, 5, 100.0), rank(1, 5, 100.0, beat_age=30.0)]
    assert watchdog.hang_cause(ranks, 10, 0, now=109.0) is None
    cause, stalled = watchdog.hang_cause(ranks, 10, 0, now=111.0)
    assert cause.startswith("hang: no iteration completed for 11 s (timeout 10 s); rank 1 "
                            "stopped answering (no heartbeat for 30 s, at iteration 5)"), cause
    assert [r["rank"] for r in stalled] == [1]


def test_a_late_heartbeat_holds_the_verdict_until_it_is_stale():
    # frozen 0.5 s after its last iteration, with a 10 s timeout: when the timeout passes
    # its beat is 9.5 s old, not yet stale; it is not called alive, and 0.5 s later, frozen
    late = [rank(0, 5, 100.0), rank(1, 5, 100.0, beat_age=9.5)]
    assert watchdog.hang_cause(late, 10, 0, now=110.5) is None
    stale = [rank(0, 5, 100.0), rank(1, 5, 100.0, beat_age=10.5)]
    cause, stalled = watchdog.hang_cause(stale, 10, 0, now=111.0)
    assert "rank 1 stopped answering" in cause and [r["rank"] for r in stalled] == [1]


def test_alive_ranks_behind_or_all_stuck():
    cause, stalled = watchdog.hang_cause([rank(0, 6, 100.0), rank(1, 5, 90.0)], 10, 0, now=120)
    assert "rank(s) [1] behind at iteration 5, alive (the others at 6)" in cause
    assert [r["rank"] for r in stalled] == [1]
    cause, stalled = watchdog.hang_cause([rank(0, 5, 100.0), rank(1, 5, 100.0)], 10, 0, now=120)
    assert "every rank alive at iteration 5 and none completing" in cause and len(stalled) == 2


def test_default_timeout_follows_the_step_and_a_save_extends_it():
    assert watchdog.default_timeout([]) == 120.0
    assert watchdog.default_timeout([1.0, 30.0, 20.0]) == 300.0
    assert watchdog.default_timeout([2.0], eval_iters=100) == 200.0
    ranks = [rank(0, 5, 0.0, state="save"), rank(1, 5, 0.0)]
    assert watchdog.hang_cause(ranks, None, 0, now=600.0) is None  # a 10-minute save: fine
    assert watchdog.hang_cause(ranks, None, 0, now=2000.0) is not None


def test_beacon_writes_progress_beats_and_dumps_stacks_on_sigusr1(tmp_path):
    beacon = watchdog.Beacon(tmp_path, "tok", rank=0, world=1, node_id="node-a")
    try:
        beacon.after(1)
        beacon.after(2)
        (info,) = watchdog.read_group(tmp_path, "tok", after=0.0)
        assert (info["iteration"], info["pid"], info["node"]) == (2, os.getpid(), "node-a")
        assert info["beat_age_s"] < 5 and info["step_s"] is not None
        assert watchdog.read_group(tmp_path, "tok", after=time.time()) == []  # a later group's
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.2)
        stacks = (watchdog.progress_dir(tmp_path, "tok") / "stacks_0.txt").read_text()
        assert "heartbeat" in stacks or "Thread" in stacks, stacks
    finally:
        beacon.close()


@pytest.mark.slow
@pytest.mark.faults
def test_sigstopped_worker_restarts_the_group_exactly(ray_cluster, corpus, uninterrupted,
                                                      tmp_path_factory):
    """One worker of a DP 2 run is frozen (SIGSTOP) after iteration 5: within hang_timeout_s
    + 15 s the group is failed, restarted from the in-memory snapshot, and trains the
    uninterrupted run's losses; the restart row names the hang and the frozen rank."""
    from test_checkpoint import _config, _curve, _logged, _rows, _train_workers, launch_while

    out = tmp_path_factory.mktemp("hang")
    timeout = 10
    cfg, plan = _config(corpus, out, "cluster.num_workers=2", "cluster.max_failures=1",
                        f"cluster.hang_timeout_s={timeout}", "checkpoint.memory_interval=1")
    stopped: dict = {}

    def freeze(stop: threading.Event) -> None:
        while not stop.is_set() and not _logged(out / "metrics.jsonl", 5):
            time.sleep(0.05)
        time.sleep(0.5)
        workers = _train_workers()
        if workers and not stop.is_set():
            os.kill(workers[-1].pid, signal.SIGSTOP)
            stopped.update(pid=workers[-1].pid, at=time.time())
        stop.wait()
        if stopped:  # never leave a stopped process behind
            try:
                os.kill(stopped["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass

    final, _ = launch_while(cfg, plan, freeze)
    assert stopped, "no worker was stopped"
    rows = _rows(out)
    (row,) = [r for r in rows if r.get("event") == "restart"]
    assert row["cause"].startswith("hang: no iteration completed"), row["cause"]
    assert "stopped answering" in row["cause"], row["cause"]
    detected = row["time"] - row["recovery_s"]
    assert detected - stopped["at"] <= timeout + 15, (detected - stopped["at"])
    assert final["iteration"] == 8 and row["restored_from"] == "memory", row
    ref, got = uninterrupted["curve"], _curve(rows)
    for key in range(row["iteration"] + 1, 9):
        assert got[key] == pytest.approx(ref[key], abs=1e-6), key
    assert checkpoint.save_root(cfg).exists()
