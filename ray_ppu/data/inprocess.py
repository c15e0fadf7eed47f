"""Microbatches without Ray: the same samples the readers deliver, read in-process.

Used under plain torchrun (overhead benchmark, single-node debugging).
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from ray_ppu.data import idxmap
from ray_ppu.data.sampler import rank_sample_ids, valid_steps


def microbatches(spec: idxmap.SampleSpec, dp_rank: int, dp_size: int, global_batch_size: int,
                 micro_batch_size: int, start: int, stop: int,
                 split: str = "train") -> Iterator[dict]:
    """DP rank ``dp_rank``'s microbatches for steps ``start .. stop`` of ``split``, in order."""
    for step in range(start, stop):
        ids = rank_sample_ids(np.array([step]), dp_rank, dp_size, global_batch_size,
                              micro_batch_size)
        for first in range(0, len(ids), micro_batch_size):
            yield idxmap.read(spec, ids[first:first + micro_batch_size], split)


def rank_streams(spec: idxmap.SampleSpec, plan, rank: int) -> tuple:
    """Global rank ``rank``'s (training, validation) microbatch streams of ``plan``, read in
    this process from the start (None for a rank that reads no data, or no validation); for the
    runs outside Ray Train (torchrun, the benchmarks' ranks). The spec's indices must be built
    (:func:`ray_ppu.data.idxmap.datasets`, a collective) before the first read."""
    if not any(r == rank for r, _ in plan.dims.data_ranks()):
        return None, None
    args = (spec, plan.dims.coordinates(rank)["dp"], plan.data_parallel_size,
            plan.global_batch_size, plan.micro_batch_size)
    train = microbatches(*args, 0, plan.train_iters)
    valid = microbatches(*args, 0, valid_steps(plan), "valid") if plan.eval_iters else None
    return train, valid
