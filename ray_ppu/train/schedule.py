"""A global batch through Megatron-Core's forward-backward function, its losses reduced over
DP, and the validation pass that runs it forward only."""

from __future__ import annotations

import contextlib
import itertools
import math
from functools import partial
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from ray_ppu.plan import Plan
from ray_ppu.train.batch import forward_step


def mean_loss(stats: Optional[torch.Tensor], device: torch.device) -> float:
    """Token-weighted mean of [loss sum, token count] over DP, known on every rank."""
    stats = stats if stats is not None else torch.zeros(2, device=device)
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        dist.all_reduce(stats, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        last = parallel_state.get_pipeline_model_parallel_last_rank()
        dist.broadcast(stats, src=last, group=parallel_state.get_pipeline_model_parallel_group())
    return (stats[0] / stats[1].clamp(min=1)).item()


def sum_reports(reports: list, total: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Add the microbatches' [loss sum, tokens] (only the last pipeline stage has any)."""
    for report in reports:
        stats = report["lm loss"]
        total = stats if total is None else total + stats
    return total


class _Shared:
    """One global batch's microbatches read by several model chunks of an interleaved
    pipeline (M-RoPE's positions, packed rows' boundaries: every chunk needs them), each chunk
    taking them in order: the first chunk to ask for microbatch k reads it, the others get the
    same one."""

    def __init__(self, batches) -> None:
        self.batches, self.read = batches, []

    def view(self) -> Iterator[dict]:
        for k in itertools.count():
            if k == len(self.read):
                self.read.append(next(self.batches))
            yield self.read[k]


def _schedule(forward_backward, step, model: list, plan: Plan, flattened: bool, batches,
              forward_only: bool) -> list:
    """One global batch through Megatron's pipeline schedule; returns the loss reports.
    ``flattened``: microbatches travel as one row of mbs × seq_length tokens (THD packing),
    which is the activation shape pipeline stages exchange."""
    mbs, seq = ((1, plan.micro_batch_size * plan.seq_length) if flattened
                else (plan.micro_batch_size, plan.seq_length))
    # interleaved pipelines take one iterator per virtual stage; only the first and last
    # chunks pull from it, but with M-RoPE or packed rows every chunk does (a view each of the
    # shared batch)
    iterators = batches
    if len(model) > 1:
        shared = _Shared(batches) if plan.every_chunk_reads and batches is not None else None
        iterators = [shared.view() if shared else batches for _ in model]
    return forward_backward(
        forward_step_func=step,
        data_iterator=iterators,
        model=model if len(model) > 1 else model[0],
        num_microbatches=plan.num_microbatches,
        seq_length=seq,
        micro_batch_size=mbs,
        decoder_seq_length=seq,
        forward_only=forward_only,
    )


def make_schedule(plan: Plan, model: list, device: torch.device, packed: Optional[str] = None,
                  images=None):
    """``schedule(batches, forward_only)``: one global batch through Megatron's forward-backward
    function (picked for the parallel state), with :func:`forward_step`; returns loss reports.
    ``images``: a vision-language model's ImageSpec (its microbatches carry images)."""
    step = partial(forward_step, device=device, packed=packed, images=images,
                   every_chunk=plan.every_chunk_reads)
    return partial(_schedule, get_forward_backward_func(), step, model, plan, packed == "thd")


def evaluate(plan: Plan, model: list, schedule, batches, device: torch.device,
             iteration: int) -> dict:
    """``plan.eval_iters`` global batches of validation data, forward only; loss and perplexity."""
    for chunk in model:
        chunk.eval()
    total = None
    with torch.no_grad():
        for _ in range(plan.eval_iters):
            total = sum_reports(schedule(batches, forward_only=True), total)
    for chunk in model:
        chunk.train()
    loss = mean_loss(total, device)
    return {"iteration": iteration, "valid_lm_loss": loss,
            "valid_ppl": math.exp(min(loss, 20.0)),  # capped like Megatron's PPL print
            "valid_samples": plan.eval_iters * plan.global_batch_size}


def per_chunk(model: list, method: str):
    """A DDP method of each model chunk, as Megatron's schedules take it (one, or a list)."""
    return getattr(model[0], method) if len(model) == 1 else [getattr(m, method) for m in model]


@contextlib.contextmanager
def params_in_sync(model: list):
    """Parameters up to date for the body (a validation pass, a checkpoint).

    With ``overlap_param_gather`` the distributed optimizer's updated shards are all-gathered
    bucket by bucket in the next forward pass (forward pre-hooks): finish that gather now and
    keep the hooks off meanwhile, as Megatron-LM does around evaluation and saving.
    """
    hooked = model[0].ddp_config.use_distributed_optimizer and model[0].ddp_config.overlap_param_gather
    if hooked:
        for chunk in model:
            chunk.disable_forward_pre_hook(param_sync=True)
    try:
        yield
    finally:
        if hooked:
            for chunk in model:
                chunk.enable_forward_pre_hook()
