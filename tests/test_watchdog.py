"""Hang detection (ray_ppu.recovery.watchdog): the decision on the ranks' progress files, the beacon's
files and stack dump, and end to end a SIGSTOPped worker (faults suite)."""

import json
import os
import signal
import threading
import time

import psutil
import pytest

from ray_ppu import checkpoint
from ray_ppu.recovery import watchdog


def rank(r, iteration, at, beat_age=0.5, state="train", world=2, step=1.0):
    return {"rank": r, "world": world, "pid": 100 + r, "node": "n", "group_started": 0.0,
            "iteration": iteration, "state": state, "time": at, "step_s": step,
            "beat_age_s": beat_age}


def test_no_decision_before_every_rank_has_a_file():
    assert watchdog.hang_cause([rank(0, 3, 0.0)], 10, 0, now=1e6) is None  # rank 1 missing


def test_a_starting_group_has_the_startup_allowance_unless_a_rank_is_frozen():
    starting = [rank(0, None, 100.0), rank(1, None, 100.0)]
    assert watchdog.hang_cause(starting, 10, 0, now=100.0 + 1000) is None  # a long load: fine
    cause, stalled = watchdog.hang_cause(starting, 10, 0, now=100.0 + 1801)
    assert "no progress for 1801 s (timeout 1800 s); rank(s) [0, 1] alive and still starting" \
        in cause, cause
    assert len(stalled) == 2
    frozen = [rank(0, None, 100.0), rank(1, None, 100.0, beat_age=30.0)]
    cause, stalled = watchdog.hang_cause(frozen, 10, 0, now=111.0)
    assert "rank 1 stopped answering (no heartbeat for 30 s, before its first iteration)" \
        in cause, cause
    assert [r["rank"] for r in stalled] == [1]


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


def test_default_timeout_follows_the_step():
    assert watchdog.default_timeout([]) == 120.0
    assert watchdog.default_timeout([1.0, 30.0, 20.0]) == 300.0
    assert watchdog.default_timeout([2.0], eval_iters=100) == 200.0


def test_a_rank_frozen_right_after_a_save_is_a_hang_like_any_other():
    # the save of iteration 10 ended at 200 (state back to train): no save allowance after it
    after_save = [rank(0, 10, 200.0), rank(1, 10, 200.0, beat_age=30.0)]
    assert watchdog.hang_cause(after_save, None, 0, now=200.0 + 119) is None
    cause, stalled = watchdog.hang_cause(after_save, None, 0, now=200.0 + 121)
    assert "rank 1 stopped answering (no heartbeat for 30 s, at iteration 10)" in cause
    assert [r["rank"] for r in stalled] == [1]
    # frozen inside the save: named as such
    in_save = [rank(0, 10, 200.0, state="save"), rank(1, 10, 200.0, beat_age=30.0, state="save")]
    cause, _ = watchdog.hang_cause(in_save, 10, 0, now=211.0, save_progress=200.0)
    assert "rank 1 stopped answering (no heartbeat for 30 s, saving after iteration 10)" in cause


def test_a_save_that_writes_is_progress_one_that_stops_writing_is_a_hang():
    saving = [rank(0, 5, 0.0, state="save"), rank(1, 5, 0.0, state="save")]
    # started at 0, 10-minute save still writing 5 s ago: not a hang, whatever the timeout
    assert watchdog.hang_cause(saving, 10, 0, now=600.0, save_progress=595.0) is None
    cause, stalled = watchdog.hang_cause(saving, 10, 0, now=600.0, save_progress=589.0)
    assert cause == ("hang: no progress for 11 s (timeout 10 s); the checkpoint save after "
                     "iteration 5 wrote nothing (rank(s) [0, 1] saving, alive): its writers or "
                     "the storage stopped"), cause
    assert len(stalled) == 2
    # one rank still saving, the other back to training (its async save staged)
    mixed = [rank(0, 5, 0.0, state="save"), rank(1, 5, 0.0)]
    cause, stalled = watchdog.hang_cause(mixed, 10, 0, now=600.0, save_progress=589.0)
    assert "wrote nothing (rank(s) [0] saving" in cause and [r["rank"] for r in stalled] == [0]


def test_save_bytes_sums_the_directories_being_written(tmp_path):
    (tmp_path / "iter_0000004").mkdir()
    (tmp_path / "iter_0000004" / "__0_0.distcp").write_bytes(b"x" * 1000)
    (tmp_path / "iter_0000004" / "__1_0.distcp").write_bytes(b"x" * 24)
    (tmp_path / "iter_0000004" / "sub").mkdir()  # not a file: not counted
    dirs = {str(tmp_path / "iter_0000004"), str(tmp_path / "gone")}
    assert watchdog.save_bytes(dirs) == 1024
    (tmp_path / "iter_0000004" / "__0_1.distcp").write_bytes(b"x" * 76)
    assert watchdog.save_bytes(dirs) == 1100


def test_beacon_writes_progress_beats_and_dumps_stacks_on_sigusr1(tmp_path):
    beacon = watchdog.Beacon(tmp_path, "tok", rank=0, world=1, node_id="node-a")
    try:
        (info,) = watchdog.read_group(tmp_path, "tok", after=0.0)
        assert (info["iteration"], info["state"]) == (None, "starting")
        beacon.after(1)
        beacon.after(2)
        # an iteration is written by the heartbeat thread, within a beat
        deadline = time.time() + 5 * watchdog.BEAT_S
        while watchdog.read_group(tmp_path, "tok", after=0.0)[0]["iteration"] != 2:
            assert time.time() < deadline, "the iteration never reached the file"
            time.sleep(0.05)
        (info,) = watchdog.read_group(tmp_path, "tok", after=0.0)
        assert (info["iteration"], info["pid"], info["node"]) == (2, os.getpid(), "node-a")
        assert info["beat_age_s"] < 5 and info["step_s"] is not None
        # a save's start and end are written at once, with the directory it writes
        beacon.saving([tmp_path / "iter_0000002"])
        (info,) = watchdog.read_group(tmp_path, "tok", after=0.0)
        assert (info["state"], info["save_dirs"]) == ("save", [str(tmp_path / "iter_0000002")])
        beacon.saved()
        (info,) = watchdog.read_group(tmp_path, "tok", after=0.0)
        assert (info["state"], info["save_dirs"], info["iteration"]) == ("train", [], 2)
        assert watchdog.read_group(tmp_path, "tok", after=time.time()) == []  # a later group's
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.2)
        stacks = (watchdog.progress_dir(tmp_path, "tok") / "stacks_0.txt").read_text()
        assert "heartbeat" in stacks or "Thread" in stacks, stacks
    finally:
        beacon.close()


def test_a_pid_that_is_no_longer_the_ranks_process_is_not_signalled(tmp_path):
    """The watchdog ends a stalled rank by the pid and start time its progress file records:
    a process that holds that pid but started at another time (the rank died unseen and its
    pid went to a new process) gets no signal; the rank's own process and its children are
    killed."""
    import subprocess
    import sys

    stacks = tmp_path / "stacks_0.txt"
    # a rank as Beacon arms it (its stacks on SIGUSR1), with a child process (a save's writer)
    rank = subprocess.Popen([sys.executable, "-c", f"""
import faulthandler, signal, subprocess, sys, time
faulthandler.register(signal.SIGUSR1, file=open({str(stacks)!r}, "w"), all_threads=True)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
time.sleep(60)
"""])
    family = []
    try:
        proc = psutil.Process(rank.pid)
        while not proc.children():
            time.sleep(0.05)
        child = proc.children()[0]
        family = [proc, child]
        said = watchdog._end_process(rank.pid, proc.create_time() - 5.0, str(stacks))
        assert said == "(none: its process had already ended)"
        assert rank.poll() is None and child.is_running(), "another process was signalled"
        said = watchdog._end_process(rank.pid, proc.create_time(), str(stacks))
        assert "time.sleep" in said or "<string>" in said, said  # its stacks, then the kill
        assert rank.wait(timeout=10) == -signal.SIGKILL
        child.wait(timeout=10)
    finally:
        for p in family or [psutil.Process(rank.pid)]:
            try:
                p.kill()
            except psutil.Error:
                pass
        rank.wait()


def test_a_progress_write_that_fails_keeps_the_beat_and_is_retried(tmp_path, caplog):
    """A full checkpoint disk fails the progress write: the rank and its heartbeat go on, the
    failure is logged once, and the pending progress reaches the file once it can."""
    beacon = watchdog.Beacon(tmp_path, "tok", rank=0, world=1, node_id="node-a")
    folder = watchdog.progress_dir(tmp_path, "tok")
    progress = folder / "rank_0.json"
    try:
        progress.unlink()
        progress.mkdir()  # a directory where the file goes: every replace fails (an OSError)
        for i in range(1, 4):
            beacon.after(i)
        beacon.saving([tmp_path / "iter_0000003"])  # a write at once fails too: no exception
        beat_before = (folder / "beat_0").stat().st_mtime
        time.sleep(3 * watchdog.BEAT_S)
        assert (folder / "beat_0").stat().st_mtime > beat_before, "the heartbeat stopped"
        failures = [r for r in caplog.records if "progress file not written" in r.message]
        assert len(failures) == 1, [r.message for r in failures]
        progress.rmdir()  # the disk has room again
        deadline = time.time() + 5 * watchdog.BEAT_S
        while not progress.is_file():
            assert time.time() < deadline, "the pending progress was never written"
            time.sleep(0.05)
        (info,) = watchdog.read_group(tmp_path, "tok", after=0.0)
        assert (info["iteration"], info["state"]) == (3, "save")
    finally:
        beacon.close()


def _stop_process(stopped: dict, proc) -> None:
    """SIGSTOP ``proc`` (a psutil.Process): kept in ``stopped`` with the time."""
    proc.send_signal(signal.SIGSTOP)
    stopped.update(proc=proc, at=time.time())


def _release(stopped: dict) -> None:
    """Never leave a stopped process behind (the watchdog should have killed it). By its
    psutil.Process, which signals nothing once the pid is another's: the suite goes through
    the 32,768 pids in a minute or two, and a signal to a pid that came back as a thread id
    ends that thread's whole process (a raylet, the GCS, a test's worker)."""
    if stopped:
        try:
            stopped["proc"].kill()
        except psutil.Error:
            pass


def _hung_run(corpus, out, freeze, timeout: int) -> tuple[dict, dict, dict]:
    """A DP 2 run (8 iterations, saving every 4, snapshots every iteration) with ``freeze``
    injecting the fault: (final, the restart row, what was stopped)."""
    from test_checkpoint import _config, _rows, launch_while

    cfg, plan = _config(corpus, out, "cluster.num_workers=2", f"cluster.hang_timeout_s={timeout}",
                        "checkpoint.memory_interval=1")
    stopped: dict = {}

    def action(stop: threading.Event) -> None:
        try:
            freeze(stop, stopped)
            stop.wait()
        finally:
            _release(stopped)

    final, _ = launch_while(cfg, plan, action)
    assert stopped, "nothing was stopped"
    (row,) = [r for r in _rows(out) if r.get("event") == "restart"]
    return final, row, stopped


def _assert_restarted_exactly(final, row, stopped, timeout, uninterrupted, out) -> None:
    from test_checkpoint import _curve, _rows

    detected = row["time"] - row["recovery_s"]
    assert detected - stopped["at"] <= timeout + 15, (detected - stopped["at"])
    assert final["iteration"] == 8 and row["restored_from"] == "memory", row
    ref, got = uninterrupted["curve"], _curve(_rows(out))
    for key in range(row["iteration"] + 1, 9):
        assert got[key] == pytest.approx(ref[key], abs=1e-6), key


@pytest.mark.slow
@pytest.mark.faults
def test_a_rank_frozen_right_after_a_save_restarts_the_group(ray_cluster, corpus, uninterrupted,
                                                             tmp_path_factory):
    """One worker is frozen (SIGSTOP) the moment it has written the end of the save at
    iteration 4 (the checkpoint complete): no save allowance is left, so the group is failed
    within hang_timeout_s + 15 s (not 30 min) and restarted from memory with the
    uninterrupted run's losses."""
    from test_checkpoint import run_workers

    out, timeout = tmp_path_factory.mktemp("hang_after_save"), 10

    def saved(pid: int) -> bool:
        """The rank in ``pid`` has written the end of the save at iteration 4."""
        for path in out.glob("ray_train/*/progress/*/rank_*.json"):
            try:
                info = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if info["pid"] == pid:
                return info["state"] == "train" and info["iteration"] >= 4
        return False

    def freeze(stop: threading.Event, stopped: dict) -> None:
        while not stop.is_set() and not list(out.glob("ray_train/*/iter_0000004/ray_ppu_meta.json")):
            time.sleep(0.02)
        workers = run_workers(out)
        while workers and not stop.is_set() and not saved(workers[-1].pid):
            time.sleep(0.005)
        if workers and not stop.is_set():
            _stop_process(stopped, workers[-1])

    final, row, stopped = _hung_run(corpus, out, freeze, timeout)
    assert "stopped answering" in row["cause"] and "at iteration 4" in row["cause"], row["cause"]
    _assert_restarted_exactly(final, row, stopped, timeout, uninterrupted, out)


@pytest.mark.slow
@pytest.mark.faults
def test_a_save_whose_writer_is_stopped_restarts_the_group(ray_cluster, corpus, uninterrupted,
                                                           tmp_path_factory):
    """A checkpoint writer process (Megatron forks them from the rank for every save) is
    frozen during the save at iteration 4: the directory stops growing, the watchdog names
    the stalled save within hang_timeout_s + 15 s, kills the ranks and their writers, and the
    group restores from memory with the uninterrupted run's losses."""
    from test_checkpoint import _logged, run_workers

    out, timeout = tmp_path_factory.mktemp("hang_in_save"), 10

    def freeze(stop: threading.Event, stopped: dict) -> None:
        while not stop.is_set() and not _logged(out / "metrics.jsonl", 2):
            time.sleep(0.05)
        workers = run_workers(out)
        known = {c.pid for w in workers for c in w.children()}  # e.g. the results-queue server
        while not stop.is_set() and not stopped:
            for worker in workers:
                try:
                    new = [c for c in worker.children() if c.pid not in known]
                except psutil.Error:
                    continue
                if new:  # a writer of the save at iteration 4
                    _stop_process(stopped, new[0])
                    break
            time.sleep(0.002)

    final, row, stopped = _hung_run(corpus, out, freeze, timeout)
    assert "wrote nothing" in row["cause"] and "after iteration 4" in row["cause"], row["cause"]
    writer = stopped["proc"]
    assert not writer.is_running() or writer.status() == psutil.STATUS_ZOMBIE, \
        "the writer outlived it"
    _assert_restarted_exactly(final, row, stopped, timeout, uninterrupted, out)


@pytest.mark.slow
@pytest.mark.faults
def test_restarts_that_never_reach_an_iteration_stop_the_run(ray_cluster, corpus,
                                                              tmp_path_factory):
    """Under the default unlimited cluster.max_failures, a worker killed in every group
    before its first iteration: after 3 such failures the next group ends the run with one
    error naming them and the last cause, instead of restarting for ever."""
    from test_checkpoint import _config, launch_while, run_workers

    from ray_ppu.errors import CrashLoop
    from ray_ppu.monitor import restarts

    out = tmp_path_factory.mktemp("crash_loop")
    cfg, plan = _config(corpus, out, "cluster.num_workers=2", "checkpoint.memory_interval=0")
    assert cfg.cluster.max_failures == -1
    killed: list = []

    def last_failure() -> float:
        """When the controller detected the last kill's failure; 0 until it has recorded it
        (and before the first kill)."""
        tokens = [d.name for d in out.glob("ray_train/*/progress/*")]  # this launch's
        history = restarts.failures(checkpoint.save_root(cfg), tokens[0]) if tokens else []
        return history[-1].detected_at if len(history) == len(killed) and history else 0.0

    def kill_at_every_start(stop: threading.Event) -> None:
        # A group's ranks write their first progress at different times (a rank of the killed
        # group may start after the kill), so a new group is one whose rank started after the
        # controller detected and recorded the last kill's failure.
        while not stop.is_set() and len(killed) < 3:  # the 4th group stops by itself
            after = last_failure()
            if after or not killed:
                alive = {w.pid: w for w in run_workers(out)}
                for path in out.glob("ray_train/*/progress/*/rank_*.json"):  # a group starting
                    try:
                        info = json.loads(path.read_text())
                    except (OSError, ValueError):
                        continue
                    if (info["state"] == "starting" and info["group_started"] > after
                            and info["pid"] in alive):
                        alive[info["pid"]].kill()
                        killed.append(time.time())
                        break
            time.sleep(0.02)

    with pytest.raises(CrashLoop) as err:
        launch_while(cfg, plan, kill_at_every_start)
    message = str(err.value)
    assert message.startswith("the run stopped restarting: 3 worker groups in a row failed "
                              "before completing an iteration (restarts 1-3); the last: rank"), \
        message
    assert len(killed) == 3 and "\n" not in message


@pytest.mark.slow
@pytest.mark.faults
def test_sigstopped_worker_restarts_the_group_exactly(ray_cluster, corpus, uninterrupted,
                                                      tmp_path_factory):
    """One worker of a DP 2 run is frozen (SIGSTOP) after iteration 5: within hang_timeout_s
    + 15 s the group is failed, restarted from the in-memory snapshot, and trains the
    uninterrupted run's losses; the restart row names the hang and the frozen rank."""
    from test_checkpoint import _config, _curve, _logged, _rows, launch_while, run_workers

    out = tmp_path_factory.mktemp("hang")
    timeout = 10
    cfg, plan = _config(corpus, out, "cluster.num_workers=2", "cluster.max_failures=1",
                        f"cluster.hang_timeout_s={timeout}", "checkpoint.memory_interval=1")
    stopped: dict = {}

    def freeze(stop: threading.Event) -> None:
        while not stop.is_set() and not _logged(out / "metrics.jsonl", 5):
            time.sleep(0.05)
        time.sleep(0.5)
        workers = run_workers(out)
        if workers and not stop.is_set():
            _stop_process(stopped, workers[-1])
        stop.wait()
        _release(stopped)

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
