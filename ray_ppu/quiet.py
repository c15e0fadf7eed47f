"""Library notices that tell a ray_ppu user nothing, filtered once per process.

Every process that runs our code imports :mod:`ray_ppu` before torch or Megatron-Core (the
driver, Ray Train's workers unpickling their function, Ray tasks and actors), so the package
installs these filters on import. Ray's own processes (its controller, Ray Data's workers) are
not ours: what they print reaches the driver through Ray's log forwarding, which
:func:`filter_forwarded_logs` filters there. Each filter names one notice exactly; everything
else still shows.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
import warnings
from typing import Optional

# Megatron-Core warns at import, in four modules and on every rank, that Transformer Engine and
# Apex are missing and it falls back to its own kernels. Where a run's options need Transformer
# Engine, the preflight says so in one line before anything starts (ray_ppu.devices); on CPU
# the fallback is the only path.
# Without Apex, Megatron-Core's local layer spec says at import (twice: models/backends.py and
# gpt_layer_specs.py) that it uses torch's norm: that is the local spec's norm by design here,
# and TE runs use TE's fused norm either way.
_MESSAGES = (r"Transformer Engine and Apex are not installed",
             r"Apex is not installed\. Falling back to Torch Norm")
# Megatron-Core's distributed checkpoints are torch.distributed.checkpoint's ShardedTensor
# format, loaded with its load_state_dict: torch says both are deprecated, on every rank at
# every load. Megatron-Core's choice, with nothing for a ray_ppu user to change.
_FUTURE = (r"`load_state_dict` is deprecated and will be removed in future versions\. Please "
           r"use `load` instead\.",
           r"Please use DTensor instead and we are deprecating ShardedTensor\.")
# Megatron-FSDP (which we do not use) logs at import which of its back ends it found.
_QUIET_LOGGERS = ("megatron.core.distributed.fsdp",)


# Lines other Ray processes print that the driver does not forward (exact text, and why):
_FORWARDED = (
    # Ray's core worker, for every actor created with restarts on whose constructor arguments
    # were put in the object store: Ray Data's map workers (it puts the map function there
    # itself) and Ray Train's preemption watcher. A restart needs those arguments, which their
    # owners keep while the actors live; there is nothing for a user to change.
    "has constructor arguments in the object store and max_restarts > 0",
    # Ray Train's placement-group cleaner, when the run's controller has gone first (an
    # interrupted run's shutdown): it cannot ask the state API and tries again, then exits.
    "Failed to query Ray Train Controller actor state",
    # Ray Data, when a job turns its progress bars off (the demo's corpus build: bars on a
    # log are noise): how to turn them on again.
    "Progress bars disabled. To enable, set `ray.data.DataContext",
)


def show_our_logs() -> None:
    """In a process Ray started (a worker, a task): ray_ppu's lines, time-stamped, once each
    (Ray configures no handler for them, and the root logger's would repeat them)."""
    ours = logging.getLogger("ray_ppu")
    if not ours.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False


def install() -> None:
    for message in _MESSAGES:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    for message in _FUTURE:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def _drop_noise(data: dict) -> Optional[dict]:
    lines = [line for line in data.get("lines", ()) if not any(t in line for t in _FORWARDED)]
    return {**data, "lines": lines} if lines else None


def filter_forwarded_logs() -> bool:
    """In a driver connected with ``log_to_driver``: drop :data:`_FORWARDED` lines from what
    Ray forwards from other processes. Ray's dispatcher of forwarded lines is private API
    (ray._private.ray_logging, Ray pinned < 2.61): where it is not as expected, nothing is
    filtered. Returns whether the filter is in place."""
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return False
    with dispatcher._lock:
        handlers = []
        for name, handler in dispatcher.handlers:
            if name == "ray_print_logs" and not getattr(handler, "_ray_ppu_filter", False):
                handler = _filtered(handler)
            handlers.append((name, handler))
        dispatcher.handlers = handlers
    return any(getattr(h, "_ray_ppu_filter", False) for _, h in dispatcher.handlers)


def _filtered(handler):
    def emit(data):
        kept = _drop_noise(data)
        if kept is not None:
            handler(kept)

    emit._ray_ppu_filter = True
    return emit


# Lines the driver's own C++ core worker writes to its stderr (file descriptor 2, below Python:
# neither logging nor Ray's forwarding sees them), exact text and why:
_NATIVE = (
    # as in _FORWARDED: the SFT pipeline's map workers, created by the driver
    b"has constructor arguments in the object store and max_restarts > 0",
)


@contextlib.contextmanager
def native_stderr_filtered():
    """While the block runs, file descriptor 2 goes through a pipe that drops :data:`_NATIVE`
    lines and passes every other line on, in order (Python's writes to stderr included).
    What is still in the pipe when the process dies inside the block is lost: keep the block
    to the Ray Data pipeline that prints the lines."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (AttributeError, OSError, ValueError):  # no real stderr: nothing to filter
        saved = None
    if saved is None:
        yield
        return
    read, write = os.pipe()
    os.dup2(write, 2)
    os.close(write)

    def pump():
        with os.fdopen(read, "rb") as lines:
            for line in lines:
                if any(text in line for text in _NATIVE):
                    continue
                try:
                    os.write(saved, line)
                except OSError:  # the real stderr is gone: keep draining the pipe
                    pass

    thread = threading.Thread(target=pump, name="stderr-filter", daemon=True)
    thread.start()
    try:
        yield
    finally:
        try:
            sys.stderr.flush()
        finally:
            os.dup2(saved, 2)  # the pipe's last writer closed: the pump reads to its end
            thread.join(timeout=5.0)
            if not thread.is_alive():  # else a child still holds the pipe: the pump keeps saved
                os.close(saved)


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class _Plain:
    """A text stream with ANSI escape sequences taken out of what is written to it."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(_ANSI.sub("", text))
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def plain_output() -> None:
    """Colour codes only on a terminal. Ray colours the prefixes of the lines it forwards and
    its start line; in a file (a Ray job's log, a redirected run) they are noise. Call it
    before Ray is imported: Ray's log handler keeps the stream it finds then."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _Plain) and not stream.isatty():
            setattr(sys, name, _Plain(stream))
