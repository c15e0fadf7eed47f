"""Where the CPU goes while a run trains: CPU seconds per iteration of every process that is
not a training rank's main thread, by role (``benchmark.py overhead``).

The step-time gap between Ray Train and torchrun on a CPU machine is CPU taken from the ranks:
Ray's daemons, Ray Train's helpers, our readers and keepers, and threads inside the ranks.
Two snapshots of the process trees (psutil: user + system CPU of each process, and of each
thread of a rank) at two logged iterations give every role's share of the window, divided by
the iterations in it. A rank's busiest thread in the window is its training (under Ray Train
that is not the process's main thread: Ray runs the train function in a thread of its own);
every other thread of a rank is counted apart, by its name (``/proc/<pid>/task/<tid>/comm``:
the heartbeat, the reader stream, Ray's core-worker threads, gRPC, ...).
"""

from __future__ import annotations

import re

# (role, pattern in the command line), first match wins; a ray:: title names an actor's class
_ROLES = (
    ("raylet", r"/raylet( |$)"),
    ("gcs", r"gcs_server"),
    ("dashboard and agents", r"dashboard\.py|dashboard/agent\.py|runtime_env/agent|"
                             r"log_monitor\.py|autoscaler/_private/monitor\.py|"
                             r"dashboard/subprocesses|ray::Dashboard"),
    ("readers", r"ray::_Reader\b|ray::_RankReader|reader_pool"),
    ("snapshot keepers", r"ray::SnapshotKeeper|snapshot_keeper"),
    ("ray train controller and helpers", r"ray::TrainController|ray::PlacementGroupCleaner|"
                                         r"ray::SynchronizationActor|ray::PreemptionWatcher|"
                                         r"ray::TrainStateActor|ray::.*Train.*Actor"),
    ("driver", r"torch\.distributed\.run|entrypoints/pretrain\.py"),
    ("training ranks", r"RayTrainWorker|torchrun_pretrain\.py"),
    ("idle ray workers", r"ray::IDLE"),
)


def role(cmdline: str) -> str:
    for name, pattern in _ROLES:
        if re.search(pattern, cmdline):
            return name
    title = re.match(r"ray::(\w+)", cmdline)
    if title:
        return f"ray::{title.group(1)}"
    script = re.search(r"([\w.-]+\.py)\b", cmdline) or re.match(r"(\S+)", cmdline)
    return f"other: {script.group(1).rsplit('/', 1)[-1]}" if script else "other"


def snapshot(roots: list[int]) -> dict[tuple, tuple[str, float]]:
    """``{(pid, tid or None): (role, CPU seconds)}`` for every process under ``roots``
    (themselves included): one entry per process, and for a training rank one per thread
    (role ``rank thread <name>``)."""
    import psutil

    seen, out = set(), {}
    for root in roots:
        try:
            top = psutil.Process(root)
            procs = [top] + top.children(recursive=True)
        except psutil.Error:
            continue
        for proc in procs:
            if proc.pid in seen:
                continue
            seen.add(proc.pid)
            try:
                name = role(" ".join(proc.cmdline()))
                if name == "training ranks" and _forked_child(proc):
                    name = "rank children (checkpoint writers, queue server)"
                if name != "training ranks":
                    times = proc.cpu_times()
                    out[(proc.pid, None)] = (name, times.user + times.system)
                    continue
                for t in proc.threads():
                    out[(proc.pid, t.id)] = (f"rank thread {_thread_name(proc.pid, t.id)}",
                                             t.user_time + t.system_time)
            except psutil.Error:
                continue
    return out


def _thread_name(pid: int, tid: int) -> str:
    try:
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            return re.sub(r"\d+$", "N", f.read().strip()) or "?"
    except OSError:
        return "?"


def _forked_child(proc) -> bool:
    """A process forked by a rank carries its command line: its parent is a rank too."""
    try:
        parent = proc.parent()
        return parent is not None and role(" ".join(parent.cmdline())) == "training ranks"
    except Exception:
        return False


def per_iteration(before: dict, after: dict, iterations: int) -> dict[str, float]:
    """CPU seconds per iteration by role between two snapshots; processes that started in
    the window count from zero, those that ended in it are not seen (a short window). Each
    rank's busiest thread is ``training ranks: training thread``; its other threads keep
    their names."""
    deltas = {key: (name, max(0.0, cpu - before.get(key, (name, 0.0))[1]))
              for key, (name, cpu) in after.items()}
    busiest: dict[int, tuple] = {}
    for (pid, tid), (name, cpu) in deltas.items():
        if tid is not None and cpu > busiest.get(pid, (None, -1.0))[1]:
            busiest[pid] = ((pid, tid), cpu)
    training = {key for key, _ in busiest.values()}
    totals: dict[str, float] = {}
    for key, (name, cpu) in deltas.items():
        name = "training ranks: training thread" if key in training else name
        totals[name] = totals.get(name, 0.0) + cpu
    return {name: round(cpu / max(iterations, 1), 4)
            for name, cpu in sorted(totals.items(), key=lambda kv: -kv[1]) if cpu > 0}
