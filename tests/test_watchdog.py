"""Hangs are failures: the progress board names the stalled rank and the group restarts."""

import os
import signal
import threading
import time

import pytest

from ray_ppu import checkpoint, watchdog
from test_checkpoint import _config, _curve, _rows, _train_workers, launch_while


def _wait_declared(board, seconds=10.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and board.hang_cause() is None:
        time.sleep(0.05)
    return board.hang_cause()


def test_a_frozen_rank_is_named_and_the_others_are_told_to_exit(monkeypatch):
    monkeypatch.setattr(watchdog, "FROZEN_AFTER_S", 0.3)
    board = watchdog._Board(timeout_s=0.5, check_s=0.05)
    assert board.beat(0, 0, 0, "train") == "ok" and board.beat(0, 1, 0, "train") == "ok"
    time.sleep(0.8)
    assert board.hang_cause() is None  # not armed before the first completed iteration
    board.beat(0, 0, 1, "train"), board.beat(0, 1, 1, "train")  # iteration 1 done by both
    stop = threading.Event()

    def rank0_beats():  # rank 0 waits in a collective, alive; rank 1 is frozen (no beats)
        while not stop.wait(0.05):
            board.beat(0, 0, 1, "train")

    beating = threading.Thread(target=rank0_beats)
    beating.start()
    try:
        cause = _wait_declared(board)
    finally:
        stop.set()
        beating.join()
    assert cause.startswith("hang: no iteration completed for") and "after iteration 1" in cause
    assert "rank(s) [1] stopped answering" in cause, cause
    # The live rank is asked for its training thread's stack, then told to exit; the stack
    # is part of the cause the restart reports.
    assert board.beat(0, 0, 1, "train") == "stack"
    assert board.beat(0, 0, 1, "train", stack="  File x, in all_reduce\n") == "exit"
    assert "rank 0 training thread:\n  File x, in all_reduce" in board.hang_cause()
    # A new group (a restart) starts with a clean slate; the old group's stragglers exit.
    assert board.beat(1, 0, 4, "train") == "ok" and board.hang_cause() is None
    assert board.beat(0, 1, 1, "train") == "exit"


def _beating(board, beats: dict) -> tuple:
    """A thread that repeats ``beats`` (rank → (iteration, state)) every 50 ms; stop it with
    the returned event."""
    stop = threading.Event()

    def run():
        while not stop.wait(0.05):
            for rank, (iteration, state) in beats.items():
                board.beat(0, rank, iteration, state)

    thread = threading.Thread(target=run)
    thread.start()
    return stop, thread


def test_a_rank_behind_and_a_long_save(monkeypatch):
    monkeypatch.setattr(watchdog, "SAVE_TIMEOUT_S", 1.5)
    board = watchdog._Board(timeout_s=0.3, check_s=0.05)
    stop, thread = _beating(board, {0: (2, "train"), 1: (2, "save")})
    time.sleep(0.8)  # longer than the timeout, shorter than a save's allowance
    stop.set(), thread.join()
    assert board.hang_cause() is None
    # The save ended, rank 0 went on to iteration 3, rank 1 stays at 2 (alive, not moving).
    stop, thread = _beating(board, {0: (3, "train"), 1: (2, "train")})
    try:
        cause = _wait_declared(board)
    finally:
        stop.set(), thread.join()
    assert "rank(s) [1] behind at iteration 2" in cause, cause


def test_default_timeout_follows_the_step():
    assert watchdog.default_timeout([]) == 120.0
    assert watchdog.default_timeout([1.0, 30.0, 20.0]) == 200.0


@pytest.mark.slow
@pytest.mark.faults
def test_sigstopped_worker_restarts_the_group_exactly(ray_cluster, corpus, uninterrupted,
                                                      tmp_path_factory):
    """One worker of a DP 2 run is frozen (SIGSTOP) after the checkpoint at 4: within
    hang_timeout_s + 15 s the group is failed, restarted from that checkpoint, and trains the
    uninterrupted run's losses; the restart row names the hang and the frozen rank."""
    out = tmp_path_factory.mktemp("hang")
    timeout = 10
    cfg, plan = _config(corpus, out, "cluster.num_workers=2", "cluster.max_failures=1",
                        f"cluster.hang_timeout_s={timeout}")
    stopped: dict = {}
    meta = checkpoint.save_root(cfg) / "iter_0000004" / checkpoint.META_FILE

    def freeze(stop: threading.Event) -> None:
        while not stop.is_set() and not meta.exists():
            time.sleep(0.05)
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
    restart = [r for r in rows if r.get("event") == "restart"]
    assert len(restart) == 1, restart
    row = restart[0]
    assert row["cause"].startswith("hang: no iteration completed"), row["cause"]
    assert "stopped answering" in row["cause"], row["cause"]
    detected = row["time"] - row["recovery_s"]
    assert detected - stopped["at"] <= timeout + 15, (detected - stopped["at"])
    assert final["iteration"] == 8 and row["resumed_from"] == "iter_0000004"
    ref, got = uninterrupted["curve"], _curve(rows)
    for key in [5, 6, 7, 8]:
        assert got[key] == pytest.approx(ref[key], abs=1e-6), key
