"""Microbatches without Ray: the same samples the readers deliver, read in-process.

Used under plain torchrun (overhead benchmark, single-node debugging).
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from ray_ppu.data import idxmap
from ray_ppu.data.sampler import rank_sample_ids


def microbatches(spec: idxmap.SampleSpec, dp_rank: int, dp_size: int, global_batch_size: int,
                 micro_batch_size: int, start: int, stop: int,
                 split: str = "train") -> Iterator[dict]:
    """DP rank ``dp_rank``'s microbatches for steps ``start .. stop`` of ``split``, in order."""
    for step in range(start, stop):
        ids = rank_sample_ids(np.array([step]), dp_rank, dp_size, global_batch_size,
                              micro_batch_size)
        for first in range(0, len(ids), micro_batch_size):
            yield idxmap.read(spec, ids[first:first + micro_batch_size], split)
