"""``ray job stop`` on the driver: the first SIGTERM asks the workers to save and stop, a
second one (or ``checkpoint.stop_timeout_s`` later) aborts them; and a warning when Ray's job
supervisor would kill the driver before that save can finish.

Ray Train has no graceful-stop API: the driver writes a stop file the workers look for after
every iteration (:mod:`ray_ppu.launch.ray_worker`), and falls back to SIGINT, Ray Train's abort.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
from pathlib import Path

from ray_ppu.config.schema import RunConfig

log = logging.getLogger("ray_ppu")


class GracefulStop:
    """The driver's SIGTERM (``ray job stop``): once training runs, ask the workers to save
    and stop (a file they watch), and abort them if that takes longer than ``timeout_s`` or a
    second signal comes; before training starts, abort at once."""

    def __init__(self, stop_file: Path, timeout_s: float) -> None:
        self.stop_file, self.timeout_s = stop_file, timeout_s
        self.training = self.requested = False

    def __call__(self, *_) -> None:
        if not self.training or self.requested:
            signal.raise_signal(signal.SIGINT)  # Ray Train's abort (KeyboardInterrupt before)
            return
        self.requested = True
        self.stop_file.parent.mkdir(parents=True, exist_ok=True)
        self.stop_file.touch()
        log.warning("stop requested: the workers save a checkpoint after their current iteration "
                    "and stop (aborted after %g s or on a second signal)", self.timeout_s)
        timer = threading.Timer(self.timeout_s, lambda: os.kill(os.getpid(), signal.SIGINT))
        timer.daemon = True
        timer.start()


def check_stop_wait(cfg: RunConfig) -> None:
    """A submitted job (``ray job submit``) warns when ``ray job stop`` would kill it before
    the checkpoint its workers save on the stop can be written: Ray's job supervisor waits
    RAY_JOB_STOP_WAIT_TIME_S (default 3 s; the head's environment) after its SIGTERM."""
    if "RAY_JOB_CONFIG_JSON_ENV_VAR" not in os.environ:  # set only in a submitted job's driver
        return
    wait = float(os.environ.get("RAY_JOB_STOP_WAIT_TIME_S", 3))
    if wait < cfg.checkpoint.stop_timeout_s:
        log.warning("`ray job stop` kills this job %g s after asking it to stop "
                    "(RAY_JOB_STOP_WAIT_TIME_S on the head node), but the checkpoint saved on a "
                    "stop may take up to checkpoint.stop_timeout_s=%g s: a stop may lose the "
                    "work since the last save; start the head with RAY_JOB_STOP_WAIT_TIME_S=%d "
                    "(cluster/start-head.sh does)", wait, cfg.checkpoint.stop_timeout_s,
                    math.ceil(cfg.checkpoint.stop_timeout_s) + 30)
