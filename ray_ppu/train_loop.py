"""The training loop: Megatron-Core's schedule over microbatches, then an optimizer step.

Imports no Ray. The caller hands in a :class:`TrainState`, this rank's microbatch iterator
(None on ranks that read no data) and :class:`Hooks` for logging, per-iteration work and
saving; the same loop runs under Ray Train and under torchrun. It follows Megatron-Core's
simple train loop: ``forward_step`` returns ``(output, loss_func)`` and
``get_forward_backward_func()`` runs the microbatches.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_attr_wrapped_model

from ray_ppu.plan import Plan

Microbatch = dict  # tokens, labels, loss_mask, position_ids: [micro_batch_size, seq_length]
_INT_KEYS = ("tokens", "labels", "position_ids")


def _as_tensors(batch: dict, device: torch.device) -> dict:
    # torch.tensor copies (Ray Data hands out read-only arrays from its object store) and
    # widens the int32 ids to the int64 Megatron's embedding and loss expect.
    return {k: torch.tensor(v, dtype=torch.float32 if k == "loss_mask" else torch.int64)
            .to(device, non_blocking=True) for k, v in batch.items() if k != "sample_id"}


def packed_attention_mask(cu_seqlens: torch.Tensor, seq_length: int) -> torch.Tensor:
    """Block-diagonal causal mask [b, 1, s, s] for rows packing several samples.

    ``cu_seqlens`` [b, K]: sample boundaries per row, padded with its last value (= s). True
    means masked out (Megatron's convention: ``attention_mask_func`` fills True with -10000):
    a token sees earlier tokens of its own sample only.
    """
    positions = torch.arange(seq_length, device=cu_seqlens.device)
    # sample index of each position: how many boundaries after the first lie at or before it
    sample = torch.searchsorted(cu_seqlens[:, 1:].contiguous(),
                                positions.expand(len(cu_seqlens), -1).contiguous(), right=True)
    other_sample = sample[:, :, None] != sample[:, None, :]
    future = torch.ones(seq_length, seq_length, dtype=torch.bool, device=cu_seqlens.device).triu(1)
    return (other_sample | future)[:, None]


def thd_packed_seq_params(cu_seqlens: torch.Tensor, seq_length: int):
    """Megatron's PackedSeqParams (THD) for a microbatch of packed rows flattened into one.

    ``cu_seqlens`` [b, K]: each row's boundaries, padded with its last value. Row r's
    boundaries shift by r·s; the repeats are dropped. Transformer Engine's attention then runs
    causal attention within each sample only, and RoPE restarts at each sample.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    offsets = torch.arange(len(cu_seqlens), device=cu_seqlens.device)[:, None] * seq_length
    bounds = torch.unique_consecutive((cu_seqlens + offsets).reshape(-1)).to(torch.int32)
    longest = int((bounds[1:] - bounds[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=bounds, cu_seqlens_kv=bounds,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def get_batch(batches: Optional[Iterator[Microbatch]], model, device: torch.device,
              packed: Optional[str] = None) -> dict:
    """Next microbatch for this model chunk, broadcast from TP rank 0 to its TP group.

    First pipeline stage needs tokens and positions, the last needs labels and the loss mask;
    chunks in between need nothing (Megatron's get_batch contract). Packed rows also carry
    their sample boundaries (a few ints broadcast instead of s² mask entries), from which
    every rank builds the block-diagonal mask (``packed="mask"``), or, for Transformer Engine
    (``"thd"``), the THD parameters of the microbatch flattened into one row of b·s tokens.
    """
    pre = get_attr_wrapped_model(model, "pre_process")
    post = get_attr_wrapped_model(model, "post_process")
    if not (pre or post):
        return {}
    data = None
    if parallel_state.get_tensor_model_parallel_rank() == 0:
        data = _as_tensors(next(batches), device)
    ints = tensor_parallel.broadcast_data(list(_INT_KEYS), data, torch.int64)
    floats = tensor_parallel.broadcast_data(["loss_mask"], data, torch.float32)
    batch = {**ints, **floats}
    if packed:
        cu = tensor_parallel.broadcast_data(["cu_seqlens"], data, torch.int64)["cu_seqlens"]
        b, s = batch["tokens"].shape
        if packed == "thd":
            batch = {k: v.reshape(1, b * s) for k, v in batch.items()}
            batch["packed_seq_params"] = thd_packed_seq_params(cu, s)
        else:
            batch["attention_mask"] = packed_attention_mask(cu, s)
    return batch


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of masked token losses, the token count, and both for logging (Megatron's 3-tuple)."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss.detach(), mask.sum().detach()])
    return loss, num_tokens, {"lm loss": report}


def forward_step(batches, model, device: torch.device, packed: Optional[str] = None):
    batch = get_batch(batches, model, device, packed)
    output = model(
        batch.get("tokens"),
        batch.get("position_ids"),
        # None: causal, built by the attention module; packed rows: block-diagonal causal
        batch.get("attention_mask"),
        labels=batch.get("labels"),
        packed_seq_params=batch.get("packed_seq_params"),  # THD packed rows (TE)
    )
    return output, partial(loss_func, batch.get("loss_mask"))


class _TimedIterator:
    """Wraps a microbatch iterator: adds up the time spent waiting in ``next`` and keeps the
    sample ids handed out since the last :meth:`take_ids`."""

    def __init__(self, batches: Iterator[Microbatch]) -> None:
        self.batches, self.waited_s = batches, 0.0
        self.ids: list = []
        self.squared_lengths = 0  # packed rows: Σ length² of the samples read (attention FLOPs)

    def __iter__(self):
        return self

    def __next__(self) -> Microbatch:
        start = time.perf_counter()
        try:
            batch = next(self.batches)
        finally:
            self.waited_s += time.perf_counter() - start
        if "sample_id" in batch:
            self.ids.extend(int(i) for i in batch["sample_id"])
        if "cu_seqlens" in batch:  # boundaries padded with the last one: zero-length repeats
            lengths = np.diff(np.asarray(batch["cu_seqlens"], dtype=np.int64), axis=-1)
            self.squared_lengths += int((lengths ** 2).sum())
        return batch

    def take_ids(self) -> list:
        ids, self.ids = self.ids, []
        return ids


@dataclass
class _Window:
    """Sums over the iterations since the last log line."""

    start: float
    iterations: int = 0
    skipped: int = 0
    loss_sum: Optional[torch.Tensor] = None  # [masked loss sum, token count] on the last stage
    grad_norm: float = 0.0
    data_wait_s: float = 0.0  # this rank's time blocked on the data stream at the window start
    squared_lengths: int = 0  # packed rows: the stream's Σ length² at the window start


def _mean_loss(stats: Optional[torch.Tensor], device: torch.device) -> float:
    """Token-weighted mean of [loss sum, token count] over DP, known on every rank."""
    stats = stats if stats is not None else torch.zeros(2, device=device)
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        dist.all_reduce(stats, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        last = parallel_state.get_pipeline_model_parallel_last_rank()
        dist.broadcast(stats, src=last, group=parallel_state.get_pipeline_model_parallel_group())
    return (stats[0] / stats[1].clamp(min=1)).item()


def _sum_reports(reports: list, total: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Add the microbatches' [loss sum, tokens] (only the last pipeline stage has any)."""
    for report in reports:
        stats = report["lm loss"]
        total = stats if total is None else total + stats
    return total


def _schedule(forward_backward, step, model: list, plan: Plan, flattened: bool, batches,
              forward_only: bool) -> list:
    """One global batch through Megatron's pipeline schedule; returns the loss reports.
    ``flattened``: microbatches travel as one row of mbs × seq_length tokens (THD packing),
    which is the activation shape pipeline stages exchange."""
    mbs, seq = ((1, plan.micro_batch_size * plan.seq_length) if flattened
                else (plan.micro_batch_size, plan.seq_length))
    return forward_backward(
        forward_step_func=step,
        # interleaved pipelines take one iterator per virtual stage; only the first and last
        # chunks pull from it
        data_iterator=[batches] * len(model) if len(model) > 1 else batches,
        model=model if len(model) > 1 else model[0],
        num_microbatches=plan.num_microbatches,
        seq_length=seq,
        micro_batch_size=mbs,
        decoder_seq_length=seq,
        forward_only=forward_only,
    )


def make_schedule(plan: Plan, model: list, device: torch.device, packed: Optional[str] = None):
    """``schedule(batches, forward_only)``: one global batch through Megatron's forward-backward
    function (picked for the parallel state), with :func:`forward_step`; returns loss reports."""
    step = partial(forward_step, device=device, packed=packed)
    return partial(_schedule, get_forward_backward_func(), step, model, plan, packed == "thd")


def evaluate(plan: Plan, model: list, schedule, batches, device: torch.device,
             iteration: int) -> dict:
    """``plan.eval_iters`` global batches of validation data, forward only; loss and perplexity."""
    for chunk in model:
        chunk.eval()
    total = None
    with torch.no_grad():
        for _ in range(plan.eval_iters):
            total = _sum_reports(schedule(batches, forward_only=True), total)
    for chunk in model:
        chunk.train()
    loss = _mean_loss(total, device)
    return {"iteration": iteration, "valid_lm_loss": loss,
            "valid_ppl": math.exp(min(loss, 20.0)),  # capped like Megatron's PPL print
            "valid_samples": plan.eval_iters * plan.global_batch_size}


def _flops_per_iteration(plan: Plan, timed: Optional[_TimedIterator], window: _Window,
                         device: torch.device) -> float:
    """The plan's FLOPs per iteration; with packed rows the attention term counts the real
    sample lengths: rank 0's Σ length² over the window (its DP share, × DP), sent to all."""
    if not plan.packed_sequences:
        return plan.flops_per_iteration
    squared = torch.zeros(1, dtype=torch.float64, device=device)
    if timed is not None and dist.get_rank() == 0:
        squared[0] = ((timed.squared_lengths - window.squared_lengths) / window.iterations
                      * plan.data_parallel_size)
    dist.broadcast(squared, src=0)
    rows = plan.global_batch_size * plan.seq_length ** 2
    return plan.flops_per_iteration + plan.attention_flops_coefficient * (float(squared[0]) - rows)


def _per_chunk(model: list, method: str):
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


@dataclass
class TrainState:
    """What the loop trains: the plan, this rank's model chunks in DDP, Megatron's optimizer and
    LR schedule, and the device the microbatches go to."""

    plan: Plan
    model: list
    optimizer: object
    scheduler: object
    device: torch.device


@dataclass
class Hooks:
    """What the loop calls out to, on every rank alike (a hook may run collectives).

    ``on_log(row)``: every training row (every ``log_interval`` iterations and the last) and
    every validation row. ``on_iteration(done, sample_ids)``: after every optimizer step, with
    the ids of the samples this rank read for it (None on ranks that read no data); it may answer
    ``"save"`` (save now too) or ``"stop"`` (save now, then return). ``on_save(done, metrics)``:
    a collective checkpoint save, every ``save_interval`` iterations, at the end and when
    ``on_iteration`` asks; None: no saves.
    """

    on_log: Callable[[dict], None]
    on_iteration: Optional[Callable[[int, Optional[list]], Optional[str]]] = None
    on_save: Optional[Callable[[int, dict], None]] = None


def train(state: TrainState, batches: Optional[Iterator[Microbatch]], hooks: Hooks, *,
          start_iteration: int = 0, valid_batches: Optional[Iterator[Microbatch]] = None,
          log_interval: int = 1, save_interval: Optional[int] = None,
          packed: Optional[str] = None) -> dict:
    """Run iterations ``start_iteration .. plan.train_iters``; returns the last logged metrics.

    Each iteration is a :func:`train_step`; then the hooks: ``on_iteration``, a training row for
    ``on_log`` every ``log_interval`` iterations (the window's numbers, reduced on every rank), a
    validation pass every ``plan.eval_interval`` iterations and at the end (when
    ``plan.eval_iters`` > 0), and ``on_save`` (the state is then exactly "``done`` iterations
    done", validation included). Validation and saves are kept off the step-time clock.
    ``packed``: how packed rows keep samples apart, ``"mask"`` or ``"thd"``
    (``model.packed_format``); ``"mask"`` when the plan packs and it is not given.
    """
    plan = state.plan
    _wire_gradient_sync(state.model, state.optimizer)
    if plan.packed_sequences and packed is None:
        packed = "mask"
    schedule = make_schedule(plan, state.model, state.device, packed)
    timed = _TimedIterator(batches) if batches is not None else None
    window = _Window(start=time.perf_counter())
    run_start = window.start
    # What a run resumed at its very end (nothing left to train) reports.
    metrics: dict = {"iteration": start_iteration, "train_iters": plan.train_iters,
                     "consumed_samples": start_iteration * plan.global_batch_size}

    for iteration in range(start_iteration, plan.train_iters):
        train_step(state, schedule, timed, window)
        done = iteration + 1
        last = done == plan.train_iters
        action = None
        if hooks.on_iteration is not None:
            action = hooks.on_iteration(done, timed.take_ids() if timed is not None else None)
        if done % log_interval == 0 or last:
            metrics = _training_row(state, window, timed, done, run_start)
            # the hook's cost (e.g. a Ray report) counts in the next window
            window = _Window(start=time.perf_counter(),
                             data_wait_s=timed.waited_s if timed else 0.0,
                             squared_lengths=timed.squared_lengths if timed else 0)
            hooks.on_log(metrics)
        if plan.eval_iters and (done % plan.eval_interval == 0 or last):
            with _off_the_clock(window) as took:
                with params_in_sync(state.model):
                    result = evaluate(plan, state.model, schedule, valid_batches, state.device,
                                      done)
                hooks.on_log({**result, "eval_time_s": took()})
            metrics.update(result)
        if hooks.on_save is not None and (last or action is not None
                                          or (save_interval and done % save_interval == 0)):
            with _off_the_clock(window), params_in_sync(state.model):
                hooks.on_save(done, dict(metrics))
        if action == "stop":
            return {**metrics, "stopped_at": done}
    return metrics


def train_step(state: TrainState, schedule, batches, window: "_Window") -> None:
    """One iteration: zero grads → ``forward_backward_func`` over ``plan.num_microbatches``
    microbatches (Megatron picks no-pipelining, 1F1B or interleaved from the parallel state) →
    optimizer step (clips, steps, and with the distributed optimizer all-gathers params) →
    scheduler step by the global batch in samples; its loss and grad norm go into ``window``."""
    for chunk in state.model:
        chunk.zero_grad_buffer()
    state.optimizer.zero_grad()
    losses = schedule(batches, forward_only=False)
    updated, grad_norm, _ = state.optimizer.step()
    if updated:
        state.scheduler.step(increment=state.plan.global_batch_size)
        window.grad_norm = float(grad_norm) if grad_norm is not None else math.nan
    else:
        window.skipped += 1  # fp16 overflow: Megatron skips the step and lowers the scale
    window.loss_sum = _sum_reports(losses, window.loss_sum)
    window.iterations += 1


def _wire_gradient_sync(model: list, optimizer) -> None:
    """Megatron's schedules find loss scaling and gradient reduction on the model config."""
    config = get_attr_wrapped_model(model[0], "config")
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = _per_chunk(model, "no_sync")
    if model[0].ddp_config.overlap_grad_reduce:
        # the pipeline schedules start each chunk's gradient reduction as its backward ends
        config.grad_sync_func = _per_chunk(model, "start_grad_sync")


def _training_row(state: TrainState, window: "_Window", timed: Optional[_TimedIterator],
                  done: int, run_start: float) -> dict:
    """The window's training row: loss (token-weighted over DP: a collective), schedule, speed."""
    plan, device = state.plan, state.device
    lm_loss = _mean_loss(window.loss_sum, device)  # syncs: the window's work is finished
    step_time = (time.perf_counter() - window.start) / window.iterations
    tokens_per_iteration = plan.global_batch_size * plan.seq_length
    metrics = {
        "iteration": done,
        "train_iters": plan.train_iters,
        "consumed_samples": done * plan.global_batch_size,
        "lm_loss": lm_loss,
        "lr": state.optimizer.param_groups[0]["lr"],
        "grad_norm": window.grad_norm,
        "skipped_iterations": window.skipped,
        "step_time_s": step_time,
        # rank 0's wait on its data stream per iteration (it reads on every layout)
        "data_wait_s": ((timed.waited_s - window.data_wait_s) / window.iterations
                        if timed is not None else 0.0),
        "tokens_per_s": tokens_per_iteration / step_time,
        "tokens_per_s_per_device": tokens_per_iteration / step_time / plan.world_size,
        # Megatron-LM's FLOPs per iteration, achieved per device
        "tflops_per_device": (_flops_per_iteration(plan, timed, window, device)
                              / step_time / plan.world_size / 1e12),
        "elapsed_s": time.perf_counter() - run_start,
        "eta_s": (plan.train_iters - done) * step_time,
    }
    if get_attr_wrapped_model(state.model[0], "config").fp16:
        # dynamic loss scaling: halved on overflow, grown after a window
        metrics["loss_scale"] = float(state.optimizer.get_loss_scale())
    if device.type == "cuda":  # what the allocator held at most, this rank
        metrics["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
    return metrics


@contextlib.contextmanager
def _off_the_clock(window: "_Window"):
    """Time spent in the body (validation, a save) is not step time: the window's start moves
    on by it. Yields a function giving the seconds the body took."""
    start = time.perf_counter()
    try:
        yield lambda: time.perf_counter() - start
    finally:
        window.start += time.perf_counter() - start
