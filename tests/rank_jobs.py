"""The rank side of ``conftest.launch_torchrun``: one torchrun launch of 2 CPU ranks serves
the rank-side jobs of the tests that run one after another, one job after another.

A torchrun launch costs about 7 s on 2 cores before a rank runs a line of its job (the agent,
two Pythons importing torch, Megatron-Core and transformers, gloo's rendezvous). Here the
ranks join the default process group once and run each job as its module ran under its own
launch: the module's ``__main__`` with ``sys.argv = [module, jobs.json]`` (``runpy``), so the
module's code is unchanged. Its imports stay loaded for the next job; Megatron's parallel
state is set up and torn down inside each job, as before (``ray_ppu.model.parallel.destroy``
ends the groups it added), and what the job built is collected after it. The test process
ends the launch when the next test does not use it (conftest).

Protocol (files in INBOX, the one argument): job k is ``<k>.json`` (``{"script", "jobs"}``),
written by the test process; rank r answers ``<k>.rank<r>.json`` (``{"ok"}`` or ``{"error"}``
with the traceback) once the job returned on it. ``stop`` ends the launch. A job that raises
ends its rank after answering (exit 1): torchrun then stops the other rank, which may be
waiting in a collective, and the test process starts a new launch for the next job.
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import sys
import time
import traceback
from pathlib import Path

POLL_S = 0.05


def _next_job(inbox: Path, k: int):
    """Job k's spec, or None once ``stop`` is there."""
    job = inbox / f"{k}.json"
    while not job.exists():
        if (inbox / "stop").exists():
            return None
        time.sleep(POLL_S)
    return json.loads(job.read_text())


def _answer(inbox: Path, k: int, rank: int, answer: dict) -> None:
    from ray_ppu.util.fs import atomic_write_text

    # whole or absent: the test process reads it as soon as it exists
    atomic_write_text(inbox / f"{k}.rank{rank}.json", json.dumps(answer), fsync=False)


def serve(inbox: Path) -> None:
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # conftest, the test modules
    dist.init_process_group("gloo")  # torchrun's environment
    rank, k = dist.get_rank(), 0
    while (spec := _next_job(inbox, k)) is not None:
        argv = sys.argv
        sys.argv = [spec["script"], spec["jobs"]]
        try:
            runpy.run_path(spec["script"], run_name="__main__")
        except BaseException:
            _answer(inbox, k, rank, {"error": traceback.format_exc()})
            sys.stderr.flush()
            os._exit(1)  # the other rank may wait in a collective: torchrun ends it
        finally:
            sys.argv = argv
        # what the job built is garbage now, in cycles (its module's functions and globals,
        # Megatron DDP's hooks): collected here, its gloo groups' polling threads end with it
        gc.collect()
        _answer(inbox, k, rank, {"ok": True})
        k += 1
    dist.destroy_process_group()


if __name__ == "__main__":  # dist_checkpointing starts spawn-context helpers: guard needed
    serve(Path(sys.argv[1]))
