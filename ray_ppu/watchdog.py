"""Hangs are failures too: a group that stops making progress is failed and restarted.

A rank that stops without dying (a stuck collective, a wedged device, a frozen process, a
partition that leaves it alive) stalls every rank of the group in its next collective, and
Ray Train notices nothing (its health check asks whether the process lives). So:

* every rank runs a :class:`Heartbeat` thread that tells this launch's :class:`ProgressBoard`
  (one Ray actor, owned by the driver, so it outlives the groups) every ``BEAT_S`` seconds which
  iteration it last completed and what it is doing (``train`` or ``save``);
* the board's own thread watches the group: once the first iteration is done, no completed
  iteration for ``timeout`` (``cluster.hang_timeout_s``, or max(120 s, 10 × the median step);
  a save is allowed max(timeout, 600 s)) is a hang. It names the stalled ranks — those whose
  beats stopped (the process is frozen), else those behind the others — asks the ranks that
  still answer for the stack of their training thread, records the hang as the group's failure
  cause, and tells the ranks to exit;
* each rank's heartbeat then ends its process (``os._exit``), Ray Train sees the workers die and
  restarts the group from the latest checkpoint, as after a node loss; the frozen process is
  killed by Ray Train's teardown. The restart row says ``cause: hang: …``
  (:meth:`ProgressBoard.hang_cause`, read by ``launcher.FailureRecorder``).
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import threading
import time
import traceback
from typing import Optional

import ray

log = logging.getLogger("ray_ppu")

BEAT_S = 2.0  # a rank's beat interval; silent for FROZEN_AFTER_S: its process is not running
FROZEN_AFTER_S = 4 * BEAT_S
MIN_TIMEOUT_S, STEPS_PER_TIMEOUT, SAVE_TIMEOUT_S = 120.0, 10, 600.0
NAMESPACE = "ray_ppu"


def default_timeout(step_times: list[float]) -> float:
    """max(120 s, 10 × the median step)."""
    median = statistics.median(step_times) if step_times else 0.0
    return max(MIN_TIMEOUT_S, STEPS_PER_TIMEOUT * median)


class _Board:
    """The launch's progress board (run as a threaded Ray actor; see the module docstring)."""

    def __init__(self, timeout_s: float, check_s: float = 1.0) -> None:
        self.timeout_s, self.check_s = timeout_s, check_s
        self.lock = threading.Lock()
        self._reset(-1)
        threading.Thread(target=self._watch, daemon=True).start()

    def _reset(self, group: int) -> None:
        self.group = group
        self.ranks: dict[int, dict] = {}
        self.last_progress: Optional[float] = None  # armed at the first completed iteration
        self.best = 0  # the highest iteration any rank completed
        self.done_at: list[float] = []  # when each new best was reached (the step times)
        self.declared: Optional[str] = None
        self.stacks: dict[int, str] = {}

    def beat(self, group: int, rank: int, iteration: int, state: str,
             stack: Optional[str] = None) -> str:
        """One rank's beat; the answer is ``"ok"``, ``"stack"`` (send your training thread's
        stack next time) or ``"exit"`` (a hang was declared: end this process)."""
        now = time.monotonic()
        with self.lock:
            if group > self.group:  # a new worker group: forget the old one
                self._reset(group)
            if group < self.group:
                return "exit"  # a straggler of a group already replaced
            seen = self.ranks.setdefault(rank, {"iteration": 0, "state": state})
            if state != seen["state"]:
                self.last_progress = now if self.last_progress is not None else None
            seen.update(iteration=iteration, state=state, at=now)
            if stack is not None:
                self.stacks[rank] = stack
            if iteration > self.best:
                self.best = iteration
                self.done_at.append(now)
                self.last_progress = now
            if self.declared:
                return "exit" if rank in self.stacks or not self._asking() else "stack"
            return "ok"

    def _asking(self) -> bool:
        return self.declared is not None and time.monotonic() < self.declared_at + 2 * BEAT_S

    def _limit(self) -> float:
        steps = [b - a for a, b in zip(self.done_at, self.done_at[1:])]
        limit = self.timeout_s if self.timeout_s > 0 else default_timeout(steps)
        saving = any(r["state"] == "save" for r in self.ranks.values())
        return max(limit, SAVE_TIMEOUT_S) if saving else limit

    def _watch(self) -> None:
        while True:
            time.sleep(self.check_s)
            with self.lock:
                if self.declared or self.last_progress is None:
                    continue
                now = time.monotonic()
                stalled_for = now - self.last_progress
                if stalled_for <= self._limit():
                    continue
                self.declared = self._cause(now, stalled_for)
                self.declared_at = now
            log.warning("%s", self.declared)

    def _cause(self, now: float, stalled_for: float) -> str:
        frozen = sorted(r for r, s in self.ranks.items() if now - s["at"] > FROZEN_AFTER_S)
        behind = sorted(r for r, s in self.ranks.items() if s["iteration"] < self.best)
        if frozen:
            who = f"rank(s) {frozen} stopped answering (process not running)"
        elif behind:
            who = f"rank(s) {behind} behind at iteration {min(self.ranks[r]['iteration'] for r in behind)}"
        else:
            who = "every rank waiting (a stuck collective or device)"
        return (f"hang: no iteration completed for {stalled_for:.0f} s (limit "
                f"{self._limit():.0f} s) after iteration {self.best}; {who}")

    def hang_cause(self) -> Optional[str]:
        """The declared hang of the current group with the stacks the ranks sent, else None."""
        with self.lock:
            if not self.declared:
                return None
            stacks = "".join(f"\n  rank {r} training thread:\n{s}"
                             for r, s in sorted(self.stacks.items()))
            return self.declared + stacks

    def status(self) -> dict:
        with self.lock:
            return {"group": self.group, "best": self.best, "declared": self.declared,
                    "ranks": {r: dict(s) for r, s in self.ranks.items()},
                    "stacks": dict(self.stacks)}


def board_name(token: str) -> str:
    return f"ray_ppu_progress:{token}"


def start_board(token: str, timeout_s: float):
    """The launch's board (the caller, the driver, owns it); None when hangs are not watched."""
    if timeout_s < 0:
        return None
    return ray.remote(_Board).options(
        name=board_name(token), namespace=NAMESPACE, num_cpus=0, max_concurrency=64,
    ).remote(timeout_s)


def hang_cause(token: str) -> Optional[str]:
    """The hang the board declared for the current group (None: not a hang, or no board)."""
    try:
        board = ray.get_actor(board_name(token), namespace=NAMESPACE)
        return ray.get(board.hang_cause.remote(), timeout=10)
    except Exception:  # no board (hangs not watched) or it cannot answer: not a hang
        return None


class Heartbeat:
    """A rank's beats to the board, from a daemon thread; :meth:`progress` is called by the
    training thread (the one that creates this) after each iteration and around saves."""

    def __init__(self, token: str, group: int, rank: int) -> None:
        self.group, self.rank = group, rank
        self.iteration, self.state = 0, "train"
        self.training_thread = threading.get_ident()
        try:
            self.board = ray.get_actor(board_name(token), namespace=NAMESPACE)
        except ValueError:  # hangs are not watched in this launch
            self.board = None
            return
        threading.Thread(target=self._run, name="ray_ppu-heartbeat", daemon=True).start()

    def progress(self, iteration: Optional[int] = None, state: Optional[str] = None) -> None:
        if iteration is not None:
            self.iteration = iteration
        if state is not None:
            self.state = state

    def _stack(self) -> str:
        frame = sys._current_frames().get(self.training_thread)
        return "".join(traceback.format_stack(frame)[-12:]) if frame is not None else "(gone)"

    def _run(self) -> None:
        answer = "ok"
        while True:
            stack = self._stack() if answer == "stack" else None
            try:
                answer = ray.get(self.board.beat.remote(self.group, self.rank, self.iteration,
                                                        self.state, stack), timeout=30)
            except Exception as err:  # the board is gone (the launch ended): stop beating
                log.debug("progress board unreachable: %s", err)
                return
            if answer == "exit":
                log.error("rank %d: the group is hung (see the driver's log); exiting so that "
                          "Ray Train restarts it", self.rank)
                logging.shutdown()
                os._exit(70)
            time.sleep(BEAT_S if answer == "ok" else 0.2)
