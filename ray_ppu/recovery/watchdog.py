"""Hangs are failures too: a group that stops completing iterations is failed and restarted.

A rank that stops without dying (a stuck collective, a wedged device, a frozen process, a
partition that leaves the process alive) is invisible to Ray Train for 10 minutes (its worker
health check) and to torch.distributed for 30 (the process-group timeout). So:

* **On every rank** (:class:`Beacon`, no Ray): after each iteration the rank writes its
  progress — iteration, time, median step, pid, node — to ``<save root>/progress/<token>/``
  (one small file per rank, replaced atomically), and a thread touches a heartbeat file every
  :data:`BEAT_S`. Python's ``faulthandler`` is armed on SIGUSR1 to dump every thread's stack
  into that directory: it is a C-level signal handler, so it answers even while the training
  thread is stuck inside a collective.
* **On the driver** (:class:`Watchdog`, a thread beside ``fit()``): once every rank of the
  current group has completed an iteration, no completed iteration on any rank for
  ``cluster.hang_timeout_s`` (default: max(120 s, 10 × the slowest rank's median step,
  ``eval_iters`` steps for a validation pass); 30 min while a rank is saving) means a hang.
  The stalled ranks are those whose heartbeat stopped (a frozen process); if every process
  still beats, the ranks behind the others; if none is behind, all (a collective or device
  that never returns). A heartbeat late but not yet stale holds the verdict until it is one
  or the other. The watchdog writes the cause for the controller's failure record
  (the restart row then says ``cause: hang: …``), asks each stalled process for its stacks
  (SIGUSR1), logs them, and SIGKILLs it, from a task on its node: Ray Train sees the worker
  die and restarts the group as after a crash.

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
SAVE_TIMEOUT_S = 1800.0  # a durable save may take long at scale; saves that fail are reported
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
        self.dir = progress_dir(root, token)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rank, self.world, self.node_id = rank, world, node_id
        self.started = time.time()
        self._steps: list[float] = []
        self._last: Optional[float] = None
        self._stacks = open(self.dir / f"stacks_{rank}.txt", "w")
        faulthandler.register(signal.SIGUSR1, file=self._stacks, all_threads=True)
        self._stop = threading.Event()
        self._write(None, "starting")
        self._thread = threading.Thread(target=self._beat, name="heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        beat = self.dir / f"beat_{self.rank}"
        while not self._stop.is_set():
            beat.touch()
            self._stop.wait(BEAT_S)

    def _write(self, iteration: Optional[int], state: str) -> None:
        atomic_write_text(self.dir / f"rank_{self.rank}.json", json.dumps({
            "rank": self.rank, "world": self.world, "pid": os.getpid(), "node": self.node_id,
            "group_started": self.started, "iteration": iteration, "state": state,
            "time": time.time(),
            "step_s": statistics.median(self._steps[-20:]) if self._steps else None}),
            fsync=False)

    def after(self, iteration: int, *_) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self._steps.append(now - self._last)
        self._last = now
        self._write(iteration, "train")

    def saving(self, iteration: int) -> None:
        self._write(iteration, "save")

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
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


def hang_cause(ranks: list[dict], timeout_s: Optional[float], eval_iters: int,
               now: float) -> Optional[tuple[str, list[dict]]]:
    """``(cause, stalled ranks)`` when the group in ``ranks`` hangs, else None (module
    docstring). Nothing is decided before every rank has completed an iteration."""
    if not ranks or len(ranks) < ranks[0]["world"] or any(r["iteration"] is None for r in ranks):
        return None
    limit = timeout_s or default_timeout([r["step_s"] for r in ranks if r["step_s"]], eval_iters)
    if any(r["state"] == "save" for r in ranks):
        limit = max(limit, SAVE_TIMEOUT_S)
    quiet = now - max(r["time"] for r in ranks)
    if quiet <= limit:
        return None
    frozen = [r for r in ranks if r["beat_age_s"] > STALE_BEAT_S]
    if not frozen and any(r["beat_age_s"] > LATE_BEAT_S for r in ranks):
        # a heartbeat has stopped but is not stale yet (a rank frozen right after its last
        # iteration, with a timeout near STALE_BEAT_S): decide once it beats or goes stale,
        # at most STALE_BEAT_S later, rather than call a frozen rank alive
        return None
    lowest = min(r["iteration"] for r in ranks)
    behind = [r for r in ranks if r["iteration"] == lowest]
    if frozen:
        why = "; ".join(f"rank {r['rank']} stopped answering (no heartbeat for "
                        f"{r['beat_age_s']:.0f} s, at iteration {r['iteration']})" for r in frozen)
        stalled = frozen
    elif len(behind) < len(ranks):
        why = (f"rank(s) {[r['rank'] for r in behind]} behind at iteration {lowest}, alive "
               f"(the others at {max(r['iteration'] for r in ranks)})")
        stalled = behind
    else:
        why = (f"every rank alive at iteration {lowest} and none completing (a collective or "
               f"device that does not return)")
        stalled = ranks
    return (f"hang: no iteration completed for {quiet:.0f} s (timeout {limit:.0f} s); {why}",
            stalled)


def _end_process(pid: int, stacks: str) -> str:
    """On the rank's node: its stacks (SIGUSR1, faulthandler), then SIGKILL."""
    text = ""
    try:
        os.kill(pid, signal.SIGUSR1)
        time.sleep(2.0)  # a stopped process dumps nothing; a stuck one in milliseconds
        text = Path(stacks).read_text()[-4000:]
    except OSError:
        pass
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
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
        while not self._stop.wait(POLL_S):
            history = restarts.failures(self.root, self.token)
            after = max([handled] + [f.detected_at for f in history])
            found = hang_cause(read_group(self.root, self.token, after), self.timeout_s,
                               self.eval_iters, time.time())
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
            r["pid"], str(progress_dir(self.root, self.token) / f"stacks_{r['rank']}.txt")): r
            for r in stalled}
        for ref, r in refs.items():
            try:
                stacks = ray.get(ref, timeout=30)
            except Exception as err:  # its node is gone too: Ray Train will see that
                stacks = f"(no answer from its node: {type(err).__name__})"
            log.error("rank %d (pid %d) ended; its threads' stacks:\n%s", r["rank"], r["pid"],
                      stacks.strip() or "(none: the process did not answer, e.g. stopped)")
