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
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core.distributed import finalize_model_grads
from megatron.core.utils import get_attr_wrapped_model

from ray_ppu.plan import Plan
from ray_ppu.train.batch import Microbatch, TimedIterator
from ray_ppu.train.schedule import (mean_loss, per_chunk, sum_reports, evaluate,
                                    make_schedule, params_in_sync)


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
    images: int = 0  # a vision-language model: the stream's images read at the window start


def _window_counts(plan: Plan, timed: Optional[TimedIterator], window: _Window,
                   device: torch.device) -> tuple[float, float]:
    """Per iteration over the window: Σ length² of the packed samples and the images the
    batches held, from rank 0's stream (its DP share, × DP), sent to all; (0, 0) when the
    plan's own counts stand (unpacked text)."""
    if not (plan.packed_sequences or plan.flops_per_image):
        return 0.0, 0.0
    counts = torch.zeros(2, dtype=torch.float64, device=device)
    if timed is not None and dist.get_rank() == 0:
        per_iteration = plan.data_parallel_size / window.iterations
        counts[0] = (timed.squared_lengths - window.squared_lengths) * per_iteration
        counts[1] = (timed.images - window.images) * per_iteration
    dist.broadcast(counts, src=0)
    return float(counts[0]), float(counts[1])


def _flops_per_iteration(plan: Plan, squared_lengths: float, images: float) -> float:
    """The plan's FLOPs per iteration, counted from what the batches held: packed rows'
    attention by their samples' lengths, a vision-language model's ViT by its images (the
    plan counts full rows and one image per sample)."""
    flops = plan.flops_per_iteration
    if plan.packed_sequences:
        rows = plan.global_batch_size * plan.seq_length ** 2
        flops += plan.attention_flops_coefficient * (squared_lengths - rows)
    if plan.flops_per_image:
        flops += plan.flops_per_image * (images - plan.global_batch_size)
    return flops


@dataclass
class TrainState:
    """What the loop trains: the plan, this rank's model chunks in DDP, Megatron's optimizer and
    LR schedule, and the device the microbatches go to."""

    plan: Plan
    model: list
    optimizer: object
    scheduler: object
    device: torch.device
    # a MoE model's routing statistics (:mod:`ray_ppu.train.moe_metrics`); None when dense
    expert_load: Optional[object] = None
    # a vision-language model's ImageSpec: how its microbatches' uint8 images are normalised
    images: Optional[object] = None


@dataclass
class Hooks:
    """What the loop calls out to, on every rank alike (a hook may run collectives).

    ``on_log(row)``: every training row (every ``log_interval`` iterations and the last) and
    every validation row. ``on_iteration(done, sample_ids)``: after every optimizer step, with
    the ids of the samples this rank read for it (None on ranks that read no data); it may answer
    ``"save"`` (save now too) or ``"stop"`` (save now, then return). ``on_save(done, metrics)``:
    a collective checkpoint save, every ``save_interval`` iterations, at the end and when
    ``on_iteration`` asks; None: no saves. ``on_iteration_done(done)``: once the iteration's
    validation is done too, before its save (an in-memory snapshot taken there covers the
    validation, as a checkpoint does: a group restored from it owes none).
    """

    on_log: Callable[[dict], None]
    on_iteration: Optional[Callable[[int, Optional[list]], Optional[str]]] = None
    on_save: Optional[Callable[[int, dict], None]] = None
    on_iteration_done: Optional[Callable[[int], None]] = None


def train(state: TrainState, batches: Optional[Iterator[Microbatch]], hooks: Hooks, *,
          start_iteration: int = 0, valid_batches: Optional[Iterator[Microbatch]] = None,
          log_interval: int = 1, save_interval: Optional[int] = None,
          packed: Optional[str] = None, profiler=None) -> dict:
    """Run iterations ``start_iteration .. plan.train_iters``; returns the last logged metrics.

    Each iteration is a :func:`train_step`; then the hooks: ``on_iteration``, a training row for
    ``on_log`` every ``log_interval`` iterations (the window's numbers, reduced on every rank), a
    validation pass every ``plan.eval_interval`` iterations and at the end (when
    ``plan.eval_iters`` > 0), and ``on_save`` (the state is then exactly "``done`` iterations
    done", validation included), ``on_iteration_done`` just before it. Validation and saves
    are kept off the step-time clock.
    ``packed``: how packed rows keep samples apart, ``"mask"`` or ``"thd"``
    (``model.packed_format``); ``"mask"`` when the plan packs and it is not given.
    ``profiler``: a :class:`~ray_ppu.monitor.step_profile.StepProfiler` around the steps.
    """
    plan = state.plan
    wire_gradient_sync(state.model, state.optimizer)
    if plan.packed_sequences and packed is None:
        packed = "mask"
    schedule = make_schedule(plan, state.model, state.device, packed, state.images)
    timed = TimedIterator(batches) if batches is not None else None
    try:
        return _iterations(state, hooks, schedule, timed, valid_batches, start_iteration,
                           log_interval, save_interval, profiler)
    finally:
        if profiler is not None:  # a run that ended before the last profiled iteration
            profiler.finish()


def _iterations(state: TrainState, hooks: Hooks, schedule, timed, valid_batches,
                start_iteration: int, log_interval: int, save_interval: Optional[int],
                profiler) -> dict:
    """The loop of :func:`train` from ``start_iteration``: steps, rows, validation, saves."""
    plan = state.plan
    window = _Window(start=time.perf_counter())
    run_start = window.start
    # What a run resumed at its very end (nothing left to train) reports.
    metrics: dict = {"iteration": start_iteration, "train_iters": plan.train_iters,
                     "consumed_samples": start_iteration * plan.global_batch_size}

    for iteration in range(start_iteration, plan.train_iters):
        with profiler.iteration(iteration + 1) if profiler else contextlib.nullcontext():
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
                             squared_lengths=timed.squared_lengths if timed else 0,
                             images=timed.images if timed else 0)
            hooks.on_log(metrics)
        if plan.eval_iters and (done % plan.eval_interval == 0 or last):
            with _off_the_clock(window) as took:
                with params_in_sync(state.model):
                    result = evaluate(plan, state.model, schedule, valid_batches, state.device,
                                      done)
                hooks.on_log({**result, "eval_time_s": took()})
            metrics.update(result)
        if hooks.on_iteration_done is not None:  # its cost counts in the next row's step
            hooks.on_iteration_done(done)
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
    with torch.profiler.record_function("ray_ppu.optimizer"):
        updated, grad_norm, _ = state.optimizer.step()
    if updated:
        state.scheduler.step(increment=state.plan.global_batch_size)
        window.grad_norm = float(grad_norm) if grad_norm is not None else math.nan
    else:
        window.skipped += 1  # fp16 overflow: Megatron skips the step and lowers the scale
    window.loss_sum = sum_reports(losses, window.loss_sum)
    window.iterations += 1


def wire_gradient_sync(model: list, optimizer) -> None:
    """Megatron's schedules find loss scaling and gradient reduction on the model config."""
    config = get_attr_wrapped_model(model[0], "config")
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = per_chunk(model, "no_sync")
    if model[0].ddp_config.overlap_grad_reduce:
        # the pipeline schedules start each chunk's gradient reduction as its backward ends
        config.grad_sync_func = per_chunk(model, "start_grad_sync")


def _training_row(state: TrainState, window: "_Window", timed: Optional[TimedIterator],
                  done: int, run_start: float) -> dict:
    """The window's training row: loss (token-weighted over DP: a collective), schedule, speed."""
    plan, device = state.plan, state.device
    lm_loss = mean_loss(window.loss_sum, device)  # syncs: the window's work is finished
    step_time = (time.perf_counter() - window.start) / window.iterations
    squared, images = _window_counts(plan, timed, window, device)  # collective
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
        "tflops_per_device": (_flops_per_iteration(plan, squared, images)
                              / step_time / plan.world_size / 1e12),
        "elapsed_s": time.perf_counter() - run_start,
        "eta_s": (plan.train_iters - done) * step_time,
    }
    if plan.flops_per_image:  # a vision-language model
        metrics["images_per_iteration"] = images
        metrics["images_per_s"] = images / step_time
    if state.expert_load is not None:  # collective, like the loss
        metrics.update(state.expert_load.row(window.iterations * plan.num_microbatches))
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
