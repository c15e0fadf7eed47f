"""Every random number generator a rank draws from, captured and set back.

Python, NumPy, torch (and CUDA's, on PPUs) and Megatron-Core's RNG tracker (the named states
its tensor-parallel dropout uses): a resumed run draws the same numbers as one that never
stopped. Checkpoints store them per (PP, TP) rank (:func:`_rng_sharded`); in-memory snapshots
(``ray_ppu.recovery.snapshot``) take :func:`capture_rng` as it is.

Megatron-Core is imported inside the functions, not with this module: the driver imports this
package and must not pay for (or need) Megatron-Core.
"""

from __future__ import annotations

import random

import numpy as np
import torch


def capture_rng(with_cuda: bool) -> dict:
    from megatron.core import tensor_parallel

    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if with_cuda:
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded(with_cuda: bool):
    """This rank's RNG states as a ShardedObject: one per (PP, TP) rank, DP ranks are replicas
    (they are seeded alike), as Megatron-LM stores them."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return ShardedObject(
        "rng_state", capture_rng(with_cuda),
        (parallel_state.get_pipeline_model_parallel_world_size(),
         parallel_state.get_tensor_model_parallel_world_size()),
        (parallel_state.get_pipeline_model_parallel_rank(),
         parallel_state.get_tensor_model_parallel_rank()),
        replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True),
    )
