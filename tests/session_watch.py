"""A pytest plugin: a session that dies without pytest's summary says what it was doing and
what Ray's logs say.

A test session's process can end below Python, silently: its Ray core worker ends it with
``_exit(1)`` when the session's raylet dies or its GCS stays unreachable for 60 s (what it
logs then goes to its stderr, which pytest holds captured for the running test, and to a log
file). CI then shows the progress dots stopping and ``exit 1``, nothing else. So the session
starts a watcher (this file run as a script) with the terminal's real output. pytest tells
it each test it starts and that the session finished; if the session's process is gone
before it finished, the watcher prints the test it was in and the errors of the session's
Ray logs: its driver's own (found by its pid), the raylet's and the GCS's, and the tail of
the prelaunch helper's output. It exits when the session's process does, printing nothing
otherwise.

The session's own Ray is shut down after pytest's summary, and not waited for beyond
:data:`SHUTDOWN_S` (:func:`shutdown_at_end`): Ray's shutdown can hang for good in closing its GCS
subscribers (ray-project/ray#44836, #45044; seen twice here after a full run), which would
hold CI for its 90 minutes after every test passed.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

POLL_S = 0.5
SHUTDOWN_S = 60.0  # ray.shutdown() of the session's Ray takes 2 to 5 s on 2 cores
RUNNING, FINISHED = "running", "finished"  # the files pytest writes in the watch directory
LINES = 12  # per log


HELPER = "helper"  # the prelaunch helper's output file (conftest tells it)
_dir: list[Path] = []  # the watch directory, once the watcher runs


def tell(name: str, text: str) -> None:
    """Leave ``text`` for the watcher as the file ``name`` (whole or absent)."""
    if _dir:
        tmp = _dir[0] / f"{name}.tmp"
        tmp.write_text(text)
        tmp.replace(_dir[0] / name)


def pytest_configure(config) -> None:
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: its controller watches
        return
    _dir.append(Path(tempfile.mkdtemp(prefix="session_watch_")))
    capture = config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():  # the real stdout, not pytest's capture of it
        sys.stdout.flush()
        subprocess.Popen([sys.executable, __file__, str(os.getpid()), str(_dir[0])],
                         stdin=subprocess.DEVNULL, start_new_session=True)


def pytest_runtest_logstart(nodeid, location) -> None:
    tell(RUNNING, nodeid)


_status: list[int] = []  # the session's exit status, once it finished
_at_end: list = []  # what shuts down the session's Ray (conftest's ray_cluster)


def pytest_sessionfinish(session, exitstatus) -> None:
    _status[:] = [int(exitstatus)]


def shutdown_at_end(shutdown) -> None:
    """Call ``shutdown`` (the session's Ray's) after pytest's summary, guarded as
    :func:`guarded` guards it."""
    _at_end.append(shutdown)


def pytest_unconfigure(config) -> None:
    tell(FINISHED, "")
    for shutdown in _at_end:
        guarded(shutdown, SHUTDOWN_S, _status[0] if _status else 1)


def guarded(shutdown, timeout_s: float, status: int) -> None:
    """``shutdown()``; if it has not returned in ``timeout_s``, say so on stderr, kill this
    process's children (the Ray it started: GCS, raylet and the rest, and their workers) and
    end with ``status``, the session's own."""
    import threading

    def give_up() -> None:
        import psutil

        print(f"session_watch: {getattr(shutdown, '__qualname__', shutdown)} did not return in "
              f"{timeout_s:.0f} s (a known Ray hang); ending the session with its status "
              f"{status}", file=sys.__stderr__, flush=True)
        kill(psutil.Process().children(recursive=True))
        os._exit(status)

    timer = threading.Timer(timeout_s, give_up)
    timer.daemon = True
    timer.start()
    try:
        shutdown()
    finally:
        timer.cancel()


def kill(procs: list) -> list[str]:
    """SIGKILL each psutil.Process of ``procs`` still running (psutil checks its pid is still
    that process); the names of those killed."""
    import psutil

    killed = []
    for proc in procs:
        try:
            name = " ".join(proc.cmdline()[:1]) or proc.name()
            proc.kill()
            killed.append(name)
        except psutil.Error:
            pass
    return killed


def _errors(path: str, levels: tuple = (" E ", " F ", " C ")) -> list[str]:
    """The last :data:`LINES` lines of a Ray log at ``levels`` (Ray's ``[time L pid tid]``)."""
    try:
        with open(path, errors="replace") as f:
            lines = [line.rstrip() for line in f if any(lv in line[:40] for lv in levels)]
    except OSError:
        return []
    return lines[-LINES:]


def _tail(path: str) -> list[str]:
    try:
        return Path(path).read_text(errors="replace").splitlines()[-LINES:]
    except OSError:
        return []


def report(pid: int, watch_dir: Path, ray_tmp: str) -> str:
    """What to print for the session ``pid`` that died: the test it was in, then the errors
    of its Ray session's logs, whose driver log carries ``pid``."""
    running = _tail(str(watch_dir / RUNNING))
    out = [f"session_watch: the test session (pid {pid}) ended without pytest's summary, "
           f"in {running[0] if running else 'no test (before the first)'}"]
    drivers = sorted(glob.glob(f"{ray_tmp}/session_*/logs/python-core-driver-*_{pid}.log"),
                     key=os.path.getmtime)
    if not drivers:
        return "\n".join(out + ["session_watch: no Ray driver log of that pid"])
    logs = Path(drivers[-1]).parent
    out.append(f"session_watch: its Ray logs: {logs}")
    sections = [(drivers[-1], _errors(drivers[-1])),
                *[(str(logs / n), _errors(str(logs / n))) for n in ("raylet.out", "gcs_server.out")],
                *[(str(logs / n), _tail(str(logs / n))) for n in ("raylet.err", "gcs_server.err")]]
    helper = _tail(str(watch_dir / HELPER))  # the file conftest named, if it did
    if helper:
        sections.append((helper[0], _tail(helper[0])))
    for path, lines in sections:
        if lines:
            out.append(f"--- {path}")
            out.extend(lines)
    return "\n".join(out)


def watch(pid: int, watch_dir: Path) -> None:
    """Wait for the session ``pid`` to end; report it unless it finished."""
    import shutil

    import psutil

    def alive(session) -> bool:
        try:
            return session.is_running() and session.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    try:
        session = psutil.Process(pid)
    except psutil.Error:
        session = None
    while session is not None and alive(session) and not (watch_dir / FINISHED).exists():
        time.sleep(POLL_S)
    if not (watch_dir / FINISHED).exists():
        ray_tmp = os.path.join(os.environ.get("RAY_TMPDIR", tempfile.gettempdir()), "ray")
        print(report(pid, watch_dir, ray_tmp), flush=True)
    shutil.rmtree(watch_dir, ignore_errors=True)


if __name__ == "__main__":
    watch(int(sys.argv[1]), Path(sys.argv[2]))
