"""The prelaunch helper (tests/prelaunch.py) touches only its own runs' processes: a pid the
state API listed for one of its actors is put under SCHED_IDLE only while it still is that
actor's process. The suite goes through Linux's 32,768 pids every minute or two on 2 cores."""

import subprocess
import sys
import threading
import time

import psutil

from prelaunch import _actor_process


def test_a_listed_pid_is_used_only_while_it_is_still_a_ray_worker_started_before_the_listing():
    # a Ray worker's title (the process Ray names ray::<class>)
    worker = subprocess.Popen(["ray::_Reader", "-c", "import time; time.sleep(30)"],
                              executable=sys.executable)
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        proc, deadline = psutil.Process(worker.pid), time.monotonic() + 30
        while proc.cmdline()[:1] != ["ray::_Reader"]:  # forked, not yet the program it runs
            assert time.monotonic() < deadline, proc.cmdline()
            time.sleep(0.01)
        started = proc.create_time()
        row = {"pid": worker.pid, "class_name": "_Reader"}
        assert _actor_process(row, asked=started + 5.0).pid == worker.pid
        # the same pid listed before this process began: the listed actor's pid, reused
        assert _actor_process(row, asked=started) is None
        # a pid that came back as a thread of another process (psutil would read the process)
        assert _actor_process({"pid": thread.native_id, "class_name": "_Reader"},
                              asked=time.time() + 5.0) is None
        # a process that is no Ray worker (this one)
        assert _actor_process({"pid": psutil.Process().pid, "class_name": "_Reader"},
                              asked=time.time() + 5.0) is None
        worker.kill()
        worker.wait()
        assert _actor_process(row, asked=time.time() + 5.0) is None  # gone
    finally:
        stop.set()
        thread.join()
        worker.kill()
