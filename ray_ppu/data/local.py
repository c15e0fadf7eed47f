"""Microbatches without Ray: the same samples the Ray Data stream delivers, read in-process.

Used under plain torchrun (overhead benchmark, single-node debugging).
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from ray_ppu.data import idxmap
from ray_ppu.data.order import rank_sample_ids


def microbatches(spec: idxmap.SampleSpec, dp_rank: int, dp_size: int, global_batch_size: int,
                 micro_batch_size: int, start_iteration: int, train_iters: int) -> Iterator[dict]:
    for iteration in range(start_iteration, train_iters):
        ids = rank_sample_ids(np.array([iteration]), dp_rank, dp_size, global_batch_size)
        for start in range(0, len(ids), micro_batch_size):
            yield idxmap.read(spec, ids[start:start + micro_batch_size])
