"""The session watcher (tests/session_watch.py): a test session whose process dies without
pytest's summary is reported with the test it was in and its Ray logs' errors; one that
finished is not."""

import subprocess
import sys
import time
from pathlib import Path

import psutil

import session_watch

GCS_LOST = ("[2026-12-05 16:00:00,000 E 123 456] gcs_rpc_client.h:203: Failed to connect to "
            "GCS within 60 seconds. GCS may have been killed.")


def _watch(session: subprocess.Popen, watch_dir: Path, ray_tmp: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, session_watch.__file__, str(session.pid),
                             str(watch_dir)], stdout=subprocess.PIPE, text=True,
                            env={"RAY_TMPDIR": str(ray_tmp), "PATH": "/usr/bin:/bin"})


def test_a_session_that_dies_is_named_with_its_test_and_its_ray_logs_errors(tmp_path):
    # a session that ends below Python, as Ray's core worker ends one
    session = subprocess.Popen([sys.executable, "-c",
                                "import os, time; time.sleep(1.5); os._exit(1)"])
    logs = tmp_path / "ray" / "session_2026-12-05_16-00-00_1_1" / "logs"
    logs.mkdir(parents=True)
    (logs / f"python-core-driver-01000000ffff_{session.pid}.log").write_text(
        "[2026-12-05 15:59:00,000 I 123 123] core_worker.cc:1: Constructing CoreWorker.\n"
        + GCS_LOST + "\n")
    (logs / "raylet.out").write_text("[2026-12-05 15:59:59,000 I 7 7] node_manager.cc:1: ok\n")
    (logs / "gcs_server.err").write_text("gcs stderr line\n")
    helper_log = tmp_path / "prelaunch.log"
    helper_log.write_text("lora_run: done in 80.0 s\n")
    watch_dir = tmp_path / "watch"
    watch_dir.mkdir()
    (watch_dir / session_watch.RUNNING).write_text("tests/test_x.py::test_y")
    (watch_dir / session_watch.HELPER).write_text(str(helper_log))
    watcher = _watch(session, watch_dir, tmp_path)
    out, _ = watcher.communicate(timeout=30)
    assert session.wait() == 1
    assert "ended without pytest's summary, in tests/test_x.py::test_y" in out, out
    assert GCS_LOST in out and "gcs stderr line" in out and "lora_run: done" in out, out
    assert "Constructing CoreWorker" not in out and "node_manager.cc:1: ok" not in out, out
    assert not watch_dir.exists()


def test_a_session_that_finished_is_not_reported(tmp_path):
    session = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        watch_dir = tmp_path / "watch"
        watch_dir.mkdir()
        watcher = _watch(session, watch_dir, tmp_path)
        time.sleep(1.0)
        assert watcher.poll() is None, "the watcher left while the session ran"
        (watch_dir / session_watch.FINISHED).write_text("")
        out, _ = watcher.communicate(timeout=10)  # gone with the session still running
        assert out == "" and watcher.returncode == 0
    finally:
        session.kill()
        session.wait()


def test_a_shutdown_that_hangs_ends_the_session_with_its_status_and_its_children():
    """The session's Ray is shut down after the summary; a shutdown that does not return in
    time (Ray's known hang in closing its GCS subscribers) ends the process with the
    session's status, its child processes (the Ray it started) killed; one that returns
    ends nothing."""
    script = f"""
import subprocess, sys, time
sys.path.insert(0, {str(Path(session_watch.__file__).parent)!r})
import psutil

import session_watch
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
session_watch.guarded(lambda: time.sleep(0.1), 5.0, 4)
print("returned", flush=True)
session_watch.guarded(lambda: time.sleep(60), 1.0, 3)
print("not reached", flush=True)
"""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 3 and time.monotonic() - started < 15, proc
    child, said = proc.stdout.split()[:2]
    assert said == "returned" and "not reached" not in proc.stdout, proc.stdout
    assert "did not return in 1 s" in proc.stderr and "status 3" in proc.stderr, proc.stderr
    deadline = time.monotonic() + 10
    while psutil.pid_exists(int(child)) and psutil.Process(int(child)).status() != "zombie":
        assert time.monotonic() < deadline, "the session's child outlived it"
        time.sleep(0.1)
