"""A pytest plugin: the CPU time the whole machine spent on each test, and the run's total.

The suite is bound by CPU on a 2-core machine: most of a test's cost is in processes it
starts (Ray Train's actors and workers, torchrun ranks, entry points), which ``--durations``
does not see and which keep running while the test waits. So every run also prints the
machine's busy CPU time over the run and its ten heaviest tests by the busy CPU time spent
while each ran (``psutil.cpu_times``: every process's, so a test is charged for what runs beside
it; on an otherwise idle machine that is its own work). Wall times vary by a quarter from one
hour to the next on these machines; CPU seconds say where the work is.
"""

from __future__ import annotations

import os
import time

import psutil
import pytest

HEAVIEST = 10
_spent: list[tuple[str, float, float]] = []  # (test id, wall s, busy CPU s)


def busy_cpu_s() -> float:
    """CPU seconds this machine has spent outside idle and I/O wait since boot."""
    times = psutil.cpu_times()
    # guest time is already counted in user time (Linux)
    return (sum(times) - times.idle - getattr(times, "iowait", 0.0)
            - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Set-up, call and teardown of one test, fixtures built for it included."""
    busy, start = busy_cpu_s(), time.monotonic()
    yield
    _spent.append((item.nodeid, time.monotonic() - start, busy_cpu_s() - busy))


def pytest_terminal_summary(terminalreporter):
    if not _spent:
        return
    wall = sum(w for _, w, _ in _spent)
    busy = sum(b for _, _, b in _spent)
    cores = os.cpu_count() or 1
    write = terminalreporter.write_line
    terminalreporter.section("busiest tests (CPU time of the whole machine)")
    write(f"{busy:.0f} CPU-s busy in {wall:.0f} s of tests: {busy / (wall * cores):.0%} of "
          f"{cores} cores")
    for test, w, b in sorted(_spent, key=lambda t: -t[2])[:HEAVIEST]:
        write(f"{b:7.1f} CPU-s {w:6.1f} s  {test}")
