"""Restarts made visible: what failed, where the run resumed, what it lost, how long it took.

Ray Train's controller sees a worker group fail (a worker raised, its process or node died) and
restarts the group; the new group loads the latest complete checkpoint. The controller side
(``train_controller.FailureRecorder``, a Ray Train callback) appends each failure to
``<save root>/failures.jsonl`` with the launch's token; rank 0 of the next group reads them
(:func:`failures`) and, once its first iteration is done, logs and records a restart row in
metrics.jsonl (:func:`restart_row`). No Ray here.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from ray_ppu.errors import UserError, remote_cause

log = logging.getLogger("ray_ppu")

FAILURES_FILE = "failures.jsonl"


@dataclass(frozen=True)
class Failure:
    """One worker-group failure as the Ray Train controller saw it."""

    token: str
    """The launch it belongs to (a resumed launch of the same output dir has another)."""
    detected_at: float
    """When the controller saw it (time.time()): a dead process is seen at its next health
    check, so this is a little after the failure itself."""
    cause: str
    """The first failed rank's error: exception type and first line."""
    ranks: tuple
    """The world ranks that reported an error."""
    reached: Optional[int] = None
    """The highest iteration a rank of the failed group had completed (its progress files);
    None: the group failed before completing one."""
    user_error: Optional[str] = None
    """The message of a :class:`ray_ppu.errors.UserError` a rank raised (a config, input or
    checkpoint problem: the same run fails the same way again), else None."""


def cause_of(errors: dict) -> str:
    """One line naming what failed: ``rank 1: ActorDiedError: The actor died …``."""
    if not errors:
        return "unknown"
    rank = min(errors)
    err = errors[rank]
    text = f"rank {rank}: {_first_line(err)}"
    inner = getattr(err, "health_check_failure", None)  # Ray Train: why the check failed
    return f"{text} ({_first_line(inner)})" if inner is not None else text


def _user_error(errors: dict) -> Optional[str]:
    """The first rank's UserError message inside Ray's wrappers, if a rank raised one."""
    for rank in sorted(errors):
        try:
            found = remote_cause(errors[rank], (UserError,)) or (
                errors[rank] if isinstance(errors[rank], UserError) else None)
        except Exception:  # never in the way of the record
            found = None
        if found is not None:
            return str(found)
    return None


def _first_line(err: BaseException) -> str:
    lines = [line for line in str(err).strip().splitlines() if line.strip()] or [""]
    return f"{type(err).__name__}: {lines[0][:200]}"


def record_failure(root: str | Path, token: str, errors: dict,
                   reached: Optional[int] = None) -> Failure:
    """Append a failure (``errors``: world rank → exception; ``reached``: the failed group's
    highest completed iteration) to ``<root>/failures.jsonl``.

    Never raises: it runs in Ray Train's controller, which must go on restarting the group
    even when the record cannot be written (a full disk); the restart then goes unreported.
    """
    failure = Failure(token=token, detected_at=time.time(),
                      cause=_take_hang(root, token) or cause_of(errors),
                      ranks=tuple(sorted(errors)), reached=reached,
                      user_error=_user_error(errors))
    path = Path(root) / FAILURES_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:  # one short line per write: appends do not interleave
            f.write(json.dumps(asdict(failure)) + "\n")
    except OSError as err:
        log.warning("could not record the failure in %s (%s): the restart will not be "
                    "reported", path, err)
    return failure


HANG_FILE = "hang_{token}.json"


def record_hang(root: str | Path, token: str, cause: str) -> None:
    """The driver's watchdog declared a hang (``ray_ppu.recovery.watchdog``): the controller's record
    of the failure that follows (the stalled workers' deaths) takes this as its cause."""
    path = Path(root) / HANG_FILE.format(token=token)
    path.write_text(json.dumps({"cause": cause, "time": time.time()}))


def _take_hang(root: str | Path, token: str) -> Optional[str]:
    path = Path(root) / HANG_FILE.format(token=token)
    try:
        cause = json.loads(path.read_text())["cause"]
    except (OSError, ValueError, KeyError):
        return None
    path.unlink(missing_ok=True)
    return cause


def failures(root: str | Path, token: str) -> list[Failure]:
    """This launch's failures so far, oldest first."""
    try:
        lines = (Path(root) / FAILURES_FILE).read_text().splitlines()
    except FileNotFoundError:
        return []
    found = []
    for line in lines:
        try:
            values = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a crash of the controller
            continue
        if values.get("token") == token:
            found.append(Failure(**{**values, "ranks": tuple(values.get("ranks", ()))}))
    return found


# Restarts that make no progress: this many in a row stop the run (crash_loop).
CRASH_LOOP_REPEATS = 3


def crash_loop(history: list[Failure], repeats: int = CRASH_LOOP_REPEATS) -> Optional[str]:
    """The one-line error a run stops with instead of restarting again, or None.

    * the last failure was a user error (a config, input or checkpoint problem): it would
      fail the same way again, so its own message;
    * the last ``repeats`` groups all failed before completing an iteration, or all in the
      same iteration with the same cause (numbers aside: pids, addresses and sizes differ
      between attempts). A deterministic bug (an out-of-memory at one step, a bad batch, a
      broken install) would otherwise restart for ever under the default unlimited
      ``cluster.max_failures``.
    """
    if history and history[-1].user_error is not None:
        return f"{history[-1].user_error} (not restarted: the same run fails the same way)"
    last = history[-repeats:]
    if repeats < 1 or len(last) < repeats:
        return None
    if all(f.reached is None for f in last):
        why = f"{repeats} worker groups in a row failed before completing an iteration"
    elif len({(f.reached, re.sub(r"\d+", "#", f.cause)) for f in last}) == 1:
        why = f"the same failure {repeats} times in a row in iteration {last[-1].reached + 1}"
    else:
        return None
    return (f"the run stopped restarting: {why} (restarts {len(history) - repeats + 1}-"
            f"{len(history)}); the last: {last[-1].cause}. Fix the cause and run the same "
            f"config again to resume from the last checkpoint")


def last_logged_iteration(metrics_file: str | Path, before: float) -> Optional[int]:
    """The highest training iteration metrics.jsonl logged before ``before`` (a time)."""
    best = None
    try:
        with open(metrics_file) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if "lm_loss" in row and row.get("time", before) <= before:
                    best = max(best or 0, row["iteration"])
    except FileNotFoundError:
        pass
    return best


def restart_row(history: list[Failure], resumed_at: int, resumed_from: Optional[str],
                metrics_file: str | Path, first_iteration_done: float,
                restored_from: Optional[str] = None) -> dict:
    """The metrics row (and log line) of the restart after ``history[-1]``.

    ``resumed_from``: the checkpoint's name, or ``memory:<nodes>`` for an in-memory snapshot;
    ``restored_from``: ``"memory"``, ``"disk"`` or None (from scratch).

    ``iterations_lost``: iterations logged before the failure that the group trains again
    (logged ones only: with ``log_interval`` > 1 up to ``log_interval - 1`` more were lost).
    ``recovery_s``: from the failure's detection to the end of the first iteration after it.
    """
    failure = history[-1]
    last = last_logged_iteration(metrics_file, failure.detected_at)
    row = {
        "event": "restart",
        "iteration": resumed_at,
        "restarts": len(history),
        "cause": failure.cause,
        "failed_ranks": list(failure.ranks),
        "resumed_from": resumed_from,
        "restored_from": restored_from,
        "iterations_lost": max(0, (last or 0) - resumed_at),
        "recovery_s": first_iteration_done - failure.detected_at,
    }
    return row


def restart_line(row: dict) -> str:
    return (f"restart {row['restarts']} after {row['cause']}: resumed at iteration "
            f"{row['iteration']} from {row['resumed_from'] or 'scratch'}, "
            f"{row['iterations_lost']} iteration(s) lost, first iteration done "
            f"{row['recovery_s']:.1f} s after the failure was detected")
