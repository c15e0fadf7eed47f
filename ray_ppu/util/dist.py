"""The default process group for code that needs torch.distributed outside a launched job.

Megatron-Core asks ``torch.distributed`` for ranks and groups even when one process does all
the work: its index builders (BlendedDataset asks for the rank on every cache miss), and the
conversion and generation tools that build a model. In a process of its own (a Ray task or
actor, a tool, a test) the answer is rank 0 of 1; under torchrun or Ray Train the job's own
group is used, left as it is, and Megatron coordinates the ranks itself.

torch is imported inside the function: :mod:`ray_ppu.data.idxmap` uses this and is imported
on the driver, which must not pay for (or need) torch at import time.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator


@contextlib.contextmanager
def single_process_group(backend: str = "gloo", join_torchrun: bool = False) -> Iterator[None]:
    """The existing default process group; else, with ``join_torchrun`` and torchrun's
    environment (WORLD_SIZE set), the job's group from that environment; else a group of this
    process alone (rank 0 of 1, an in-memory store: no port to find). Destroyed at exit if
    created here."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        yield
        return
    if join_torchrun and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
