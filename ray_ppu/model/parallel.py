"""Megatron-Core parallel state on top of an already-initialised torch.distributed group."""

from __future__ import annotations

import contextlib
import random
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from ray_ppu.plan import Plan
from ray_ppu.util.dist import single_process_group


def initialize(plan: Plan, seed: int) -> None:
    """Build TP/PP/CP/DP (and EP / ETP) groups and seed every RNG the Megatron way.

    1. Reuse the default process group (ray_ppu.launch.process_group's under Ray Train, or torchrun's).
    2. ``initialize_model_parallel`` with the plan's sizes; check the world agrees with the plan.
    3. Seeds: ``seed + 100 × pp_rank`` for Python/NumPy/torch, then Megatron's tracker, which
       gives each TP rank its own stream for tensor-parallel regions.
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: run under Ray Train or torchrun")
    if dist.get_world_size() != plan.world_size:
        raise RuntimeError(f"world size {dist.get_world_size()} != planned {plan.world_size}")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=plan.tensor_model_parallel_size,
        pipeline_model_parallel_size=plan.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=plan.virtual_pipeline_model_parallel_size,
        context_parallel_size=plan.context_parallel_size,
        expert_model_parallel_size=plan.expert_model_parallel_size,
        expert_tensor_parallel_size=plan.expert_tensor_parallel_size,
    )
    coords = plan.dims.coordinates(dist.get_rank())
    actual = {
        "tp": parallel_state.get_tensor_model_parallel_rank(),
        "cp": parallel_state.get_context_parallel_rank(),
        "dp": parallel_state.get_data_parallel_rank(),
        "pp": parallel_state.get_pipeline_model_parallel_rank(),
    }
    if coords != actual:  # the data shards were assigned from the planned coordinates
        raise RuntimeError(f"rank {dist.get_rank()}: Megatron placed it at {actual}, planned {coords}")

    stage_seed = seed + 100 * actual["pp"]
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)


def destroy() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


@contextlib.contextmanager
def groups(plan: Plan, seed: int) -> Iterator[None]:
    """The body in Megatron's parallel groups (:func:`initialize`), torn down at exit."""
    initialize(plan, seed)
    try:
        yield
    finally:
        destroy()


def process_group(backend: str = "cpu") -> contextlib.AbstractContextManager[None]:
    """The default process group for tools outside Ray Train (conversion, generation): the
    existing one, else torchrun's (its environment), else one of this process alone.
    Destroyed at exit if created here."""
    return single_process_group("nccl" if backend == "ppu" else "gloo", join_torchrun=True)
