"""Megatron-Core parallel state on top of an already-initialised torch.distributed group.

Tearing it down also lets the model go: Megatron-Core's rotary embeddings cache their
``forward`` with ``functools.lru_cache`` on the class, whose keys hold the module, the module
holds DDP (its forward hooks) and DDP holds the process groups. Left alone, every model that
ran a forward lives as long as its process, with its gloo groups' threads (49 per model on
one CPU rank, each polling): a process that builds more than once (the option matrix, the
benchmarks' variants, the tests) slowed down with every build. :func:`destroy` empties those
caches.

It also destroys the process groups Megatron-Core's initialize added: its
``destroy_model_parallel`` forgets them but destroys only its gloo data-parallel ones, and
torch.distributed keeps the rest registered (17 groups, 51 threads per round on one CPU rank)
in a process whose default group outlives the round.
"""

from __future__ import annotations

import contextlib
import random
import sys
from typing import Iterator

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from ray_ppu.plan import Plan
from ray_ppu.util.dist import single_process_group

_added: list = []  # the process groups the last initialize() added (destroy() ends them)

_ROTARY_CACHES = [  # Megatron-Core's classes whose forward is an lru_cache keyed on the module
    ("megatron.core.models.common.embeddings.rotary_pos_embedding", "RotaryEmbedding"),
    ("megatron.core.models.common.embeddings.yarn_rotary_pos_embedding", "YarnRotaryEmbedding"),
]


def _groups() -> list:
    # torch keeps no public list of its groups; Megatron-Core reads this one too
    return list(dist.distributed_c10d._world.pg_map)


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
    before = set(_groups())
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=plan.tensor_model_parallel_size,
        pipeline_model_parallel_size=plan.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=plan.virtual_pipeline_model_parallel_size,
        context_parallel_size=plan.context_parallel_size,
        expert_model_parallel_size=plan.expert_model_parallel_size,
        expert_tensor_parallel_size=plan.expert_tensor_parallel_size,
    )
    _added[:] = [group for group in _groups() if group not in before]
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
    """Megatron's parallel state torn down, the groups it added destroyed and its rotary
    caches emptied (the module docstring): a model is freed once its caller drops it."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    registered = set(_groups())
    for group in _added:
        if group in registered:  # Megatron destroyed some itself
            dist.destroy_process_group(group)
    _added.clear()
    for module, name in _ROTARY_CACHES:
        if module in sys.modules:  # a model of this process built one
            getattr(sys.modules[module], name).forward.cache_clear()


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
