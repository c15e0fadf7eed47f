"""Hangs are failures too: a group that stops completing iterations is failed and restarted.

A rank that stops without dying (a stuck collective, a wedged device, a frozen process, a
partition that leaves the process alive) is invisible to Ray Train for 10 minutes (its worker
health check) and to torch.distributed for 30 (the process-group timeout). So:

* **On every rank** (:class:`Beacon`, no Ray): the rank's progress — its last completed
  iteration and when, its median step, whether a save is running and into which directory,
  pid, node — is kept in ``<save root>/progress/<token>/`` (one small file per rank, replaced
  atomically by the heartbeat thread, off the training step's path; a save's start and end
  are written at once), and the same thread touches a heartbeat file every :data:`BEAT_S`.
  Python's ``faulthandler`` is armed on SIGUSR1 to dump every thread's stack into that
  directory: it is a C-level signal handler, so it answers even while the training thread is
  stuck inside a collective.
* **On the driver** (:class:`Watchdog`, a thread beside ``fit()``): no progress on any rank
  for ``cluster.hang_timeout_s`` (default: max(120 s, 10 × the slowest rank's median step,
  ``eval_iters`` steps for a validation pass)) means a hang. Progress is a completed
  iteration, a save's start or end, or, while a save runs, bytes reaching its checkpoint
  directory (the driver sums the directory's files every poll): a save that writes is never
  a hang however long it takes, one that writes nothing for the timeout is (stopped writers,
  a hung shared filesystem). Before the group's first iteration the ranks have
  :data:`STARTUP_TIMEOUT_S` (imports, the model build, a checkpoint load) unless one of them
  stops answering. The stalled ranks are those whose heartbeat stopped (a frozen process);
  if every process still beats, the ranks whose save stopped writing, else the ranks behind
  the others; if none is behind, all (a collective or device that never returns). A
  heartbeat late but not yet stale holds the verdict until it is one or the other. The
  watchdog writes the cause for the controller's failure record (the restart row then says
  ``cause: hang: …``), asks each stalled process for its stacks (SIGUSR1), logs them, and
  SIGKILLs it with its child processes (a save's writers), from a task on its node: Ray
  Train sees the worker die and restarts the group as after a crash.

Why files and not Ray calls for the beats: a beat must not depend on the process it vouches
for being able to reach Ray, and the save root is already shared storage every node writes
checkpoints to.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import statistics
import threading
import time
from pathlib import Path
from typing import Optional

from ray_ppu.monitor import restarts
from ray_ppu.util.fs import atomic_write_text

log = logging.getLogger("ray_ppu")

BEAT_S = 1.0
STALE_BEAT_S = 10.0  # a heartbeat older than this: the process stopped answering
LATE_BEAT_S = 3 * BEAT_S  # older than this but not stale: no verdict yet (see hang_cause)
MIN_TIMEOUT_S = 120.0
# the first iteration of a group: imports, the model build and a checkpoint load, which at
# scale read tens of GB per node from shared storage; a rank that stops answering is not given it
STARTUP_TIMEOUT_S = 1800.0
POLL_S = 1.0


def progress_dir(root: Path, token: str) -> Path:
    return Path(root) / "progress" / token


def default_timeout(step_s: list[float], eval_iters: int = 0) -> float:
    """max(120 s, 10 × the slowest median step, a validation pass of ``eval_iters`` steps)."""
    slowest = max(step_s, default=0.0)
    return max(MIN_TIMEOUT_S, 10 * slowest, eval_iters * slowest)


class Beacon:
    """One rank's progress and heartbeat files (module docstring). No Ray."""

    def __init__(self, root: Path, token: str, rank: int, world: int, node_id: str) -> None:
        import psutil

        self.dir = progress_dir(root, token)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self._steps: list[float] = []
        self._last: Optional[float] = None
        # the pid with its start time: a pid is only this process while that matches
        self._info = {"rank": rank, "world": world, "pid": os.getpid(),
                      "pid_started": psutil.Process().create_time(), "node": node_id,
                      "group_started": time.time(), "iteration": None, "state": "starting",
                      "time": time.time(), "step_s": None, "save_dirs": []}
        self._lock = threading.Lock()
        self._dirty = self._unwritten = False
        self._stacks = open(self.dir / f"stacks_{rank}.txt", "w")
        faulthandler.register(signal.SIGUSR1, file=self._stacks, all_threads=True)
        self._stop = threading.Event()
        self._flush()
        (self.dir / f"beat_{rank}").touch()  # readable at once, before the thread's first beat
        self._thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        beat = self.dir / f"beat_{self.rank}"
        while not self._stop.is_set():
            if self._dirty:
                self._flush()
            beat.touch()
            self._stop.wait(BEAT_S)

    def _flush(self) -> None:
        """Write the progress file. A write that fails (the checkpoint disk is full: a failed
        save is counted and training goes on) never stops the rank or its heartbeat: the
        progress stays pending, retried at the next beat, and the failure is logged once."""
        with self._lock:
            text, self._dirty = json.dumps(self._info), False
        try:
            atomic_write_text(self.dir / f"rank_{self.rank}.json", text, fsync=False)
        except OSError as err:
            with self._lock:
                self._dirty = True
            if not self._unwritten:
                log.warning("rank %d: progress file not written (%s); retrying every %g s",
                            self.rank, err, BEAT_S)
            self._unwritten = True
        else:
            self._unwritten = False

    def _update(self, *, at_once: bool, **changes) -> None:
        """Change the progress; written at once (a save's start or end, rare) or by the
        heartbeat thread within :data:`BEAT_S` (an iteration: no file write on the step)."""
        with self._lock:
            self._info.update(changes, time=time.time())
            self._dirty = True
        if at_once:
            self._flush()

    def after(self, iteration: int, *_) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self._steps.append(now - self._last)
        self._last = now
        self._update(at_once=False, iteration=iteration, state="train",
                     step_s=statistics.median(self._steps[-20:]) if self._steps else None)

    def saving(self, dirs: list) -> None:
        """A save (or the wait for background saves) started, writing into ``dirs``."""
        self._update(at_once=True, state="save", save_dirs=[str(d) for d in dirs])

    def saved(self) -> None:
        self._update(at_once=True, state="train", save_dirs=[])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        if self._dirty:
            self._flush()
        faulthandler.unregister(signal.SIGUSR1)
        self._stacks.close()


def read_group(root: Path, token: str, after: float) -> list[dict]:
    """The current group's rank files (those of a group started after ``after``), each with
    its heartbeat's age."""
    ranks = []
    now = time.time()
    for path in progress_dir(root, token).glob("rank_*.json"):
        try:
            info = json.loads(path.read_text())
            beat = (path.parent / f"beat_{info['rank']}").stat().st_mtime
        except (OSError, ValueError, KeyError):
            continue  # being replaced, or its beat not written yet
        if info["group_started"] > after:
            ranks.append({**info, "beat_age_s": now - beat})
    return sorted(ranks, key=lambda r: r["rank"])


def hang_cause(ranks: list[dict], timeout_s: Optional[float], eval_iters: int, now: float,
               save_progress: Optional[float] = None) -> Optional[tuple[str, list[dict]]]:
    """``(cause, stalled ranks)`` when the group in ``ranks`` hangs, else None (module
    docstring). ``save_progress``: when the running save's directory last grew (the driver's
    measure), None when no save runs. Nothing is decided before every rank has a file."""
    if not ranks or len(ranks) < ranks[0]["world"]:
        return None
    limit = timeout_s or default_timeout([r["step_s"] for r in ranks if r["step_s"]], eval_iters)
    frozen = [r for r in ranks if r["beat_age_s"] > STALE_BEAT_S]
    starting = any(r["iteration"] is None for r in ranks)
    if starting and not frozen:
        limit = max(limit, STARTUP_TIMEOUT_S)
    last = max([r["time"] for r in ranks] + [save_progress or 0.0])
    quiet = now - last
    if quiet <= limit:
        return None
    if not frozen and any(r["beat_age_s"] > LATE_BEAT_S for r in ranks):
        # a heartbeat has stopped but is not stale yet (a rank frozen right after its last
        # iteration, with a timeout near STALE_BEAT_S): decide once it beats or goes stale,
        # at most STALE_BEAT_S later, rather than call a frozen rank alive
        return None
    done = [r["iteration"] for r in ranks if r["iteration"] is not None]
    lowest = min(done, default=None)
    behind = [r for r in ranks if r["iteration"] == lowest]
    saving = [r for r in ranks if r["state"] == "save"]
    what = "no progress" if starting or saving else "no iteration completed"
    if frozen:
        why = "; ".join(f"rank {r['rank']} stopped answering (no heartbeat for "
                        f"{r['beat_age_s']:.0f} s, {_where(r)})" for r in frozen)
        stalled = frozen
    elif saving:
        why = (f"the checkpoint save after iteration {max(done, default=0)} wrote nothing "
               f"(rank(s) {[r['rank'] for r in saving]} saving, alive): its writers or the "
               f"storage stopped")
        stalled = saving
    elif starting:
        why = (f"rank(s) {[r['rank'] for r in ranks if r['iteration'] is None]} alive and "
               f"still starting (no first iteration)")
        stalled = [r for r in ranks if r["iteration"] is None]
    elif len(behind) < len(ranks):
        why = (f"rank(s) {[r['rank'] for r in behind]} behind at iteration {lowest}, alive "
               f"(the others at {max(done)})")
        stalled = behind
    else:
        why = (f"every rank alive at iteration {lowest} and none completing (a collective or "
               f"device that does not return)")
        stalled = ranks
    return f"hang: {what} for {quiet:.0f} s (timeout {limit:.0f} s); {why}", stalled


def _where(rank: dict) -> str:
    if rank["iteration"] is None:
        return "before its first iteration"
    if rank["state"] == "save":
        return f"saving after iteration {rank['iteration']}"
    return f"at iteration {rank['iteration']}"


def save_bytes(dirs: set) -> int:
    """Bytes of the files in the checkpoint directories being written (torch_dist writes
    them flat): one listing per directory."""
    total = 0
    for d in dirs:
        try:
            with os.scandir(d) as entries:
                for entry in entries:
                    try:
                        total += entry.stat().st_size if entry.is_file() else 0
                    except OSError:  # renamed or removed meanwhile
                        pass
        except OSError:  # not made yet, or removed (a failed save)
            pass
    return total


def rank_process(pid: int, started: float):
    """The psutil.Process of a rank's progress file (its ``pid`` and ``pid_started``), or None
    once that pid is no longer the rank's process: a rank that died unseen leaves its pid to
    the next process or thread, and Linux goes through its 32,768 pids in minutes on a busy
    node."""
    import psutil

    try:
        proc = psutil.Process(pid)
        return proc if abs(proc.create_time() - started) < 0.01 else None
    except psutil.Error:
        return None


def _end_process(pid: int, started: float, stacks: str) -> str:
    """On the rank's node: its stacks (SIGUSR1, faulthandler), then SIGKILL for it and its
    child processes (a save's writers, which would outlive it, stopped or stuck). Nothing is
    signalled if ``pid`` is no longer the rank's process (:func:`rank_process`)."""
    import psutil

    proc = rank_process(pid, started)
    if proc is None:
        return "(none: its process had already ended)"
    text = ""
    try:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(2.0)  # a stopped process dumps nothing; a stuck one in milliseconds
        text = Path(stacks).read_text()[-4000:]
    except (OSError, psutil.Error):
        pass
    try:
        family = [proc] + proc.children(recursive=True)
    except psutil.Error:
        family = [proc]
    for member in family:
        try:
            member.kill()  # psutil checks the pid is still that process first
        except psutil.Error:
            pass
    return text


class Watchdog:
    """The driver's thread: fails a hung group (module docstring)."""

    def __init__(self, root: Path, token: str, timeout_s: Optional[float],
                 eval_iters: int) -> None:
        self.root, self.token = Path(root), token
        self.timeout_s, self.eval_iters = timeout_s, eval_iters
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
        self.declared: list[str] = []

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        handled = 0.0  # groups started before this were dealt with
        written, grew = None, None  # the running save's bytes, and when they last changed
        while not self._stop.wait(POLL_S):
            history = restarts.failures(self.root, self.token)
            after = max([handled] + [f.detected_at for f in history])
            ranks = read_group(self.root, self.token, after)
            dirs = {d for r in ranks if r["state"] == "save" for d in r.get("save_dirs", ())}
            size = save_bytes(dirs) if dirs else None
            if size != written:
                written, grew = size, time.time() if size is not None else None
            found = hang_cause(ranks, self.timeout_s, self.eval_iters, time.time(), grew)
            if found is None:
                continue
            cause, stalled = found
            handled = time.time()
            self.declared.append(cause)
            log.error("%s: failing the group", cause)
            restarts.record_hang(self.root, self.token, cause)
            self._end(stalled)

    def _end(self, stalled: list[dict]) -> None:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        task = ray.remote(_end_process)
        refs = {task.options(num_cpus=0, max_retries=0, scheduling_strategy=(
            NodeAffinitySchedulingStrategy(r["node"], soft=False))).remote(
            r["pid"], r["pid_started"],
            str(progress_dir(self.root, self.token) / f"stacks_{r['rank']}.txt")): r
            for r in stalled}
        for ref, r in refs.items():
            try:
                stacks = ray.get(ref, timeout=30)
            except Exception as err:  # its node is gone too: Ray Train will see that
                stacks = f"(no answer from its node: {type(err).__name__})"
            log.error("rank %d (pid %d) ended; its threads' stacks:\n%s", r["rank"], r["pid"],
                      stacks.strip() or "(none: the process did not answer, e.g. stopped)")
