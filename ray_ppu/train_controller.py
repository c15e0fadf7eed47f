"""What ray_ppu hands Ray Train's controller and its workers' process start, and only that:
the controller unpickles it before it asks for a single worker, so everything here imports
Ray and the standard library only. (It lived in ``launcher``, whose torch, Megatron-Core and checkpoint imports cost the
controller 3.8 s and 240 MB before any worker started: measured with ``/usr/bin/time python -c
'import ray.train.v2._internal.execution.controller.controller, ray_ppu.launcher'`` against
the controller's own imports alone, 5.5 s vs 1.7 s.)
"""

from __future__ import annotations

import importlib
import logging
import threading
from pathlib import Path

import ray.train

from ray_ppu import recovery

log = logging.getLogger("ray_ppu")


class FailureRecorder(ray.train.UserCallback):
    """Runs in the Ray Train controller: writes down each worker-group failure (cause, ranks,
    time) for the next group's rank 0 to report as a restart (:mod:`ray_ppu.recovery`)."""

    def __init__(self, root: Path, token: str) -> None:
        self.root, self.token = root, token

    def after_exception(self, run_context, worker_exceptions: dict) -> None:
        failure = recovery.record_failure(self.root, self.token, worker_exceptions)
        log.warning("worker group failed (%s); Ray Train restarts it if "
                    "cluster.max_failures allows", failure.cause)


# What a training worker imports before it can train (3-5 s of torch, Megatron-Core's model
# code and ours on a busy node), in the order they are needed.
_TRAINING_MODULES = ("ray_ppu.ray_worker", "ray_ppu.worker", "ray_ppu.model", "ray_ppu.optim",
                     "ray_ppu.train_loop")


def preimport() -> None:
    """Ray's ``worker_process_setup_hook`` for the training workers (``RunConfig
    .worker_runtime_env``): import the training code in a background thread from the moment
    the process starts, while Ray Train creates the worker actor and its process group;
    the train function's own imports then find it loaded, or wait for the thread's import of
    the same module (Python's per-module import locks). Readers and keepers run without it."""

    def load() -> None:
        for name in _TRAINING_MODULES:
            try:
                importlib.import_module(name)
            except Exception:  # the train function's own import reports it properly
                return

    threading.Thread(target=load, name="ray_ppu-preimport", daemon=True).start()
