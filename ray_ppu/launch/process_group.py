"""The worker group's default torch.distributed process group, set up for Ray Train by a
backend config that imports no torch.

Ray Train's controller unpickles the trainer's backend config before it asks for a single
worker. ``TorchTrainer``'s own, ``TorchConfig``, lives in ``ray.train.torch``, whose import
pulls in torch: 2.4 CPU-s (``import ray.train.v2._internal.execution.controller`` alone 1.5 s,
with ``ray.train.torch.config`` 3.7 s) spent at the start of every launch, on its critical
path, before any worker is asked for. :class:`ProcessGroupConfig` is
what ``TorchTrainer`` takes as its ``torch_config`` (it reads only ``backend``) and does for the
workers what ours need of TorchConfig's setup:

- ``MASTER_ADDR`` / ``MASTER_PORT`` of world rank 0 and torchrun's variables (``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``NODE_RANK``) on every worker;
- ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (the reference script's, unless the user set it);
- ``init_process_group`` over ``env://`` with the world rank Ray Train gave each worker
  (NCCL's asynchronous error handling on, unless the user chose: a hung collective fails);
- at the group's end, the process group destroyed (bounded: a dead peer must not hold it).

Device binding is not here: :mod:`ray_ppu.launch.ray_worker` binds each rank to the PPU Ray assigned
it. Torch is imported in the functions, which run in the workers (they import it anyway).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import ray
from ray.train.backend import Backend, BackendConfig

from ray_ppu.util.net import free_port

log = logging.getLogger("ray_ppu")

SHUTDOWN_TIMEOUT_S = 30  # a group with a dead worker: its peers' destroy may never return


@dataclass
class ProcessGroupConfig(BackendConfig):
    """The default process group of a Ray Train worker group (``TorchTrainer(torch_config=…)``)."""

    backend: str = "gloo"
    """torch.distributed backend: ``nccl`` on PPUs (their CCL speaks it), ``gloo`` on CPU."""

    timeout_s: int = 1800
    """Seconds a collective of the default group may wait (torch's ``timeout``)."""

    @property
    def backend_cls(self):
        return _ProcessGroupBackend

    @property
    def framework(self):
        # what Ray's dashboard shows as the run's framework (and whose version it records)
        from ray.train.v2._internal.util import TrainingFramework

        return TrainingFramework.TORCH

    def to_dict(self) -> dict:
        return {"backend": self.backend, "init_method": "env", "timeout_s": self.timeout_s}


class _ProcessGroupBackend(Backend):
    # with Ray's GPU resource, every worker sees all of its node's GPUs in
    # CUDA_VISIBLE_DEVICES (as TorchConfig's backend does): the id Ray assigned indexes them
    share_cuda_visible_devices = True

    def on_start(self, worker_group, backend_config: ProcessGroupConfig) -> None:
        addr, port = worker_group.execute_single(0, _rendezvous_address)
        worker_group.execute(_set_environment, addr=addr, port=port)
        world = len(worker_group)
        ray.get([worker_group.execute_single_async(rank, _init_process_group,
                                                   backend=backend_config.backend, world_rank=rank,
                                                   world_size=world,
                                                   timeout_s=backend_config.timeout_s)
                 for rank in range(world)])

    def on_shutdown(self, worker_group, backend_config: ProcessGroupConfig) -> None:
        if len(worker_group) < 2:
            return
        try:
            ray.get(worker_group.execute_async(_destroy_process_group),
                    timeout=SHUTDOWN_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            log.warning("the worker group's process group was not destroyed within %d s",
                        SHUTDOWN_TIMEOUT_S)


def _rendezvous_address() -> tuple[str, int]:
    """World rank 0's node address and a port free there: the group's rendezvous."""
    return ray.util.get_node_ip_address(), free_port()


def _set_environment(addr: str, port: int) -> None:
    """The rendezvous and torchrun's variables, from Ray Train's view of this worker."""
    context = ray.train.get_context()
    os.environ.update({
        "MASTER_ADDR": addr, "MASTER_PORT": str(port),
        "RANK": str(context.get_world_rank()), "WORLD_SIZE": str(context.get_world_size()),
        "LOCAL_RANK": str(context.get_local_rank()),
        "LOCAL_WORLD_SIZE": str(context.get_local_world_size()),
        "NODE_RANK": str(context.get_node_rank()),
    })
    # What the reference script exports and Megatron-Core asks for (its TP linear layers warn
    # on every rank without it): one hardware queue per device, so a TP / SP communication
    # is scheduled before the GEMM that overlaps it. Here, before the process touches CUDA,
    # for every launch; the user's own value wins.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")


def _init_process_group(backend: str, world_rank: int, world_size: int, timeout_s: int) -> None:
    import datetime

    import torch.distributed as dist

    # NCCL: a timed-out collective raises instead of hanging the rank (unless the user chose)
    if backend == "nccl" and "TORCH_NCCL_BLOCKING_WAIT" not in os.environ:
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if world_rank == 0:
        log.info("process group: %s over %s:%s, %d ranks", backend, os.environ["MASTER_ADDR"],
                 os.environ["MASTER_PORT"], world_size)
    dist.init_process_group(backend, init_method="env://", rank=world_rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
