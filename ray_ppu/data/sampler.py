"""Which global samples a data-parallel rank trains on, iteration by iteration.

Megatron-LM's pretraining sampler (``MegatronPretrainingSampler``, dataloader_type "single"):
the global sample ids are consumed in order; each microbatch step takes the next
``micro_batch_size × dp_size`` ids and DP rank *r* keeps ``[r × mbs, (r+1) × mbs)`` of them.
So iteration *i* consumes global samples ``[i × gbs, (i+1) × gbs)``, and microbatch *m* of
rank *r* in it is ``i × gbs + m × mbs × dp + r × mbs + [0, mbs)``.

The set of samples an iteration consumes depends on the iteration alone, never on DP: a run
restarted with a different DP size (elastic) continues the same global sequence.
"""

from __future__ import annotations

import numpy as np


def rank_sample_ids(iterations: np.ndarray, dp_rank: int, dp_size: int,
                    global_batch_size: int, micro_batch_size: int) -> np.ndarray:
    """Global sample ids DP rank ``dp_rank`` reads for ``iterations``, in training order.

    Returns a flat array: for each iteration, its ``num_microbatches`` microbatches of
    ``micro_batch_size`` ids each, microbatch after microbatch.
    """
    step = micro_batch_size * dp_size  # ids consumed by one microbatch step across DP
    if global_batch_size % step:
        raise ValueError(f"global batch {global_batch_size} is not a multiple of "
                         f"micro batch {micro_batch_size} × DP {dp_size} = {step}")
    microbatches = global_batch_size // step
    iterations = np.asarray(iterations, dtype=np.int64)
    ids = (iterations[:, None, None] * global_batch_size
           + np.arange(microbatches, dtype=np.int64)[None, :, None] * step
           + dp_rank * micro_batch_size
           + np.arange(micro_batch_size, dtype=np.int64)[None, None, :])
    return ids.reshape(-1)


def consumed_samples(iteration: int, global_batch_size: int) -> int:
    """Samples consumed before ``iteration`` (Megatron's ``args.consumed_train_samples``)."""
    return iteration * global_batch_size


def valid_steps(plan) -> int:
    """Validation global batches a whole run reads (``plan.valid_samples`` / global batch)."""
    return plan.valid_samples // plan.global_batch_size


def valid_start(iteration: int, eval_interval: int, eval_iters: int) -> int:
    """First validation step of a run resumed after ``iteration``: each pass so far read
    ``eval_iters`` fresh global batches (Megatron's valid consumed samples, in batches)."""
    return iteration // eval_interval * eval_iters
