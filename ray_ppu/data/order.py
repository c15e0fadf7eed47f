"""Which global samples a data-parallel rank trains on, iteration by iteration.

Megatron's pretraining sampler: iteration *i* consumes global samples
``[i × global_batch, (i+1) × global_batch)``; DP rank *r* takes its contiguous slice of
``micro_batch_size × num_microbatches`` of them, microbatch after microbatch. The order is a
function of the sample index alone, so it does not change when DP does.
"""

from __future__ import annotations

import numpy as np


def rank_sample_ids(iterations: np.ndarray, dp_rank: int, dp_size: int,
                    global_batch_size: int) -> np.ndarray:
    """Global sample ids DP rank ``dp_rank`` reads for ``iterations``, in training order."""
    per_rank = global_batch_size // dp_size  # micro_batch_size × num_microbatches
    base = np.asarray(iterations, dtype=np.int64)[:, None] * global_batch_size + dp_rank * per_rank
    return (base + np.arange(per_rank, dtype=np.int64)[None, :]).reshape(-1)
