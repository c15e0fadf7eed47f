"""What ray_ppu hands Ray Train's controller, and only that: the controller unpickles it
before it asks for a single worker, so everything here imports Ray and the standard library
only. (It lived in ``launcher``, whose torch, Megatron-Core and checkpoint imports cost the
controller 3.8 s and 240 MB before any worker started: measured with ``/usr/bin/time python -c
'import ray.train.v2._internal.execution.controller.controller, ray_ppu.launch.launcher'`` against
the controller's own imports alone, 5.5 s vs 1.7 s.)
"""

from __future__ import annotations

import logging
from pathlib import Path

import ray.train

from ray_ppu.monitor import restarts
from ray_ppu.recovery.watchdog import read_group

log = logging.getLogger("ray_ppu")


class FailureRecorder(ray.train.UserCallback):
    """Runs in the Ray Train controller: writes down each worker-group failure (cause, ranks,
    time) for the next group's rank 0 to report as a restart (:mod:`ray_ppu.monitor.restarts`)."""

    def __init__(self, root: Path, token: str) -> None:
        self.root, self.token = root, token

    def after_exception(self, run_context, worker_exceptions: dict) -> None:
        # how far the failed group got: its ranks' progress files (those written since the
        # last failure), which the next group reads to tell progress from a crash loop
        history = restarts.failures(self.root, self.token)
        ranks = read_group(self.root, self.token, history[-1].detected_at if history else 0.0)
        reached = max((r["iteration"] for r in ranks if r["iteration"] is not None), default=None)
        failure = restarts.record_failure(self.root, self.token, worker_exceptions, reached)
        log.warning("worker group failed (%s); Ray Train restarts it if "
                    "cluster.max_failures allows", failure.cause)

