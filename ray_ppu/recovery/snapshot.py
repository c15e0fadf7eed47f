"""In-memory snapshots, the worker side: take one after an iteration, send it to the keepers
(:mod:`ray_ppu.recovery.snapshot_keeper`), and restore a restarted group from the newest complete one.

What a snapshot is: one rank's own shard of the full training state, as it stands after an
iteration — each model chunk's ``state_dict`` (its TP/PP shard), each optimizer's main
parameters and torch-optimizer state (its DP shard of the distributed optimizer; Adam's
moments and steps), the grad scaler, the schedule, the RNG states and the iteration. The data
position follows from the iteration (the streams start there, as after a disk checkpoint).

Why per rank and not Megatron's sharded checkpoint format: a snapshot is taken every
iteration, and Megatron's save planning alone costs 0.3–6 s at the tiny preset; a per-rank
copy is a memcpy. A group of the same layout (world, TP, PP, CP, DP, virtual PP, EP, ETP)
loads each rank's own snapshot as it is; an elastically resized one (another world and DP, the
same model shards) assembles each rank's optimizer ranges from the old ranks' snapshots
(:mod:`ray_ppu.recovery.snapshot_reshard`: every snapshot records which parameter range each optimizer
position holds, and the rank's coordinates).

Cost on the training thread: the copy of the state (``blocking_s``). Serializing it and
sending it to the two keepers happens in a background thread, at most one snapshot in
flight (the next waits for the previous: the keepers then always hold, per rank, a snapshot at
most one behind every other rank's, so :data:`~ray_ppu.recovery.snapshot_keeper.KEEP` = 2 leaves a
complete one). With ``checkpoint.memory_interval`` unset the first snapshot is timed and every
rank takes the same interval: 1, or as many iterations as keep a snapshot within 2 % of the
step (on a CPU device the background thread's CPU time counts too: it shares the cores).
"""

from __future__ import annotations

import concurrent.futures
import io
import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ray_ppu import checkpoint
from ray_ppu.checkpoint import parts
from ray_ppu.checkpoint.rng import capture_rng, restore_rng
from ray_ppu.recovery.snapshot_reshard import (coords, param_keys, reshardable, restore_resharded,
                                      shard_ranges)
from ray_ppu.util.wrappers import unwrap

log = logging.getLogger("ray_ppu")

BUDGET = 0.02  # of the step time, for the automatic interval
CALIBRATION_STEPS = 3  # steps timed (after the first of the group) before choosing it
ONE_NODE = "; one node only: they cover worker crashes, a node loss falls back to disk"


@dataclass(frozen=True)
class MemoryPoint:
    """A complete in-memory snapshot a restarted group starts from (beside
    :class:`ray_ppu.checkpoint.ResumePoint` for disk)."""

    iteration: int
    nodes: tuple
    """The nodes whose keepers this rank's group reads from."""
    fetch: Callable[[int], bytes] = field(compare=False, repr=False)
    """The snapshot of a rank of the group that took them (this rank's own transfer starts
    when the point is made, when the layout is the same)."""
    sources: Optional[dict] = field(default=None, compare=False, repr=False)
    """None: the same layout, each rank loads its own. Else ``{old rank: coordinates}`` of the
    old group, whose snapshots this group reshards (:mod:`ray_ppu.recovery.snapshot_reshard`)."""
    origin: dict = field(default_factory=dict, compare=False)
    """Where the run's weights came from (the checkpoint meta's hf fields), as on disk."""
    weights_only: bool = False

    @property
    def path(self) -> str:
        return "memory:" + ",".join(n[:8] for n in self.nodes)


def layout_of(plan) -> tuple:
    """What a snapshot's group must share with the group restoring it."""
    return (plan.world_size, plan.tensor_model_parallel_size, plan.pipeline_model_parallel_size,
            plan.context_parallel_size, plan.data_parallel_size,
            plan.virtual_pipeline_model_parallel_size or 1,
            # a MoE model's experts: which ones, and which slice of each, a rank holds
            plan.expert_model_parallel_size, plan.expert_tensor_parallel_size)


def _optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _copy(value):
    """A deep copy with every tensor copied to host memory (the device's stays in use)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(v) for v in value)
    return value


def capture(iteration: int, model: list, optimizer, scheduler, with_cuda: bool) -> dict:
    """This rank's training state after ``iteration``, copied (training may go on).

    With ``overlap_param_gather`` the weights outside this rank's optimizer shard are still
    the previous iteration's here (the next forward gathers them); only the shard matters: a
    restored model gathers every weight from the shards at its first forward (or validation)
    as the uninterrupted run does. Main parameters that are views of the weights (fp32 with
    the distributed optimizer) are not copied twice: the weights restore them.
    """
    weights = {p.untyped_storage().data_ptr() for chunk in model for p in chunk.parameters()}
    part = parts.of_model(model)
    keys = param_keys(model)
    optimizers = []
    for opt in _optimizers(optimizer):
        inner = opt.optimizer
        scaler = getattr(opt, "grad_scaler", None)
        optimizers.append({
            "mains": [None if p.untyped_storage().data_ptr() in weights
                      else p.detach().to("cpu", copy=True)
                      for group in inner.param_groups for p in group["params"]],
            "inner": _copy(inner.state_dict()),
            "grad_scaler": _copy(scaler.state_dict()) if scaler is not None else None,
            # which parameter range each position holds: a group of another DP size reshards
            "ranges": shard_ranges(opt, keys) if reshardable(opt) else None,
        })
    return {"iteration": iteration,
            "coords": tuple(coords()),
            "reshardable": all(o["ranges"] is not None for o in optimizers),
            # a LoRA run's: what trains (its base is read again at every start)
            "model": [_copy(parts.plain(unwrap(chunk), part)) for chunk in model],
            "optimizers": optimizers,
            "scheduler": _copy(scheduler.state_dict()),
            "rng": capture_rng(with_cuda)}


def serialize(state: dict) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def restore(point: MemoryPoint, model: list, optimizer, scheduler) -> int:
    """Load this rank's snapshot of ``point`` into the freshly built model, optimizer and
    schedule (and the RNG); returns the iteration training continues at."""
    if point.sources is not None:
        return restore_resharded(point.iteration, point.sources, point.fetch, model,
                                 _optimizers(optimizer), scheduler)
    state = torch.load(io.BytesIO(point.fetch(dist.get_rank())), map_location="cpu",
                       weights_only=False)
    if state["iteration"] != point.iteration:
        raise checkpoint.CheckpointError(f"the {point.path} snapshot holds iteration "
                                         f"{state['iteration']}, not {point.iteration}")
    for chunk, weights in zip(model, state["model"], strict=True):
        parts.load(unwrap(chunk), weights, parts.of_model(model), point.path)
    for opt, saved in zip(_optimizers(optimizer), state["optimizers"], strict=True):
        mains = [p for group in opt.optimizer.param_groups for p in group["params"]]
        with torch.no_grad():  # the exact fp32 main values, not ones rebuilt from the weights
            for main, value in zip(mains, saved["mains"], strict=True):
                if value is not None:  # None: a view of the weights, restored with them
                    main.copy_(value)
        opt.optimizer.load_state_dict(saved["inner"])
        if saved["grad_scaler"] is not None:
            opt.grad_scaler.load_state_dict(saved["grad_scaler"])
    scheduler.num_steps = 0  # Megatron's load steps a schedule on by the saved count
    scheduler.load_state_dict(state["scheduler"])
    restore_rng(state["rng"])
    return state["iteration"]


def agree(propose: Callable[[], Optional[tuple]], group) -> Optional[tuple]:
    """Rank 0's ``propose()``, the same on every rank of ``group`` (a gloo group)."""
    chosen = [propose() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(chosen, src=0, group=group)
    return chosen[0]


class Snapshotter:
    """After each iteration: take this rank's snapshot when due and send it, in a background
    thread, to ``send(iteration, shards, blob)`` (the keepers; ``shards``: the rank's
    coordinates and whether its snapshot reshards, for the keepers' index). ``interval``: None = choose (module
    docstring); ``group``: a gloo group over the training ranks, for that choice."""

    def __init__(self, send: Callable[[int, tuple, bytes], None], interval: Optional[int],
                 with_cuda: bool, cpu_device: bool, group, replica: bool) -> None:
        self.send, self.interval, self.with_cuda = send, interval, with_cuda
        self.cpu_device, self.group, self.replica = cpu_device, group, replica
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="snapshot")
        self._inflight: Optional[concurrent.futures.Future] = None
        self._steps: list[float] = []
        self._last: Optional[float] = None
        self.blocking_s: list[float] = []  # per snapshot: the training thread's wait
        self.sent = 0
        self.failed = 0  # snapshots a keeper did not take
        if interval is not None and dist.get_rank() == 0:
            log.info("in-memory snapshots every %d iteration(s)%s", interval,
                     "" if replica else ONE_NODE)

    def after(self, iteration: int, model: list, optimizer, scheduler) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self._steps.append(now - self._last)
        due = self.interval is None or iteration % self.interval == 0
        if due and (self.interval is not None or not self.blocking_s):
            self._take(iteration, model, optimizer, scheduler)
        if self.interval is None and len(self._steps) == CALIBRATION_STEPS:
            self.interval = self._choose()
        self._last = time.perf_counter()

    def _take(self, iteration: int, model: list, optimizer, scheduler) -> None:
        started = time.perf_counter()
        self._settle()  # one in flight: the keepers stay at most one behind
        state = capture(iteration, model, optimizer, scheduler, self.with_cuda)
        self.blocking_s.append(time.perf_counter() - started)
        self._inflight = self._pool.submit(self._send, iteration, state)

    def _send(self, iteration: int, state: dict) -> tuple[float, float]:
        started, cpu = time.perf_counter(), time.thread_time()
        self.send(iteration, (state["coords"], state["reshardable"]), serialize(state))
        self.sent += 1
        return time.perf_counter() - started, time.thread_time() - cpu

    def _settle(self) -> Optional[tuple[float, float]]:
        """Wait for the snapshot in flight; its (wall, CPU) seconds of sending, or None when
        there was none or it failed (a keeper gone with its node: the next one goes to the
        keepers still there; the durable checkpoints stand meanwhile)."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return None
        try:
            return inflight.result()
        except Exception as err:
            self.failed += 1
            if self.failed == 1:
                log.warning("an in-memory snapshot was not kept (%s: %s); training goes on",
                            type(err).__name__, str(err).splitlines()[0] if str(err) else "")
            return None

    def _choose(self) -> int:
        """The interval every rank takes: the slowest rank's cost against the step."""
        send_s, send_cpu_s = self._settle() or (0.0, 0.0)
        cost = self.blocking_s[0] + (send_cpu_s if self.cpu_device else 0.0)
        step = statistics.median(self._steps[1:] or self._steps)  # the first is the slowest
        figures = torch.tensor([cost, -step, self.blocking_s[0], send_s], dtype=torch.float64)
        dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=self.group)
        cost, step = float(figures[0]), -float(figures[1])
        interval = max(1, math.ceil(cost / (BUDGET * step))) if step > 0 else 1
        if dist.get_rank() == 0:
            log.info("in-memory snapshots every %d iteration(s): one costs %.0f ms of a %.0f ms "
                     "step (%.1f %%; blocking %.0f ms, sending %.0f ms in the background%s), "
                     "within %.0f %% of the step%s", interval, cost * 1e3, step * 1e3,
                     100 * cost / step, float(figures[2]) * 1e3, float(figures[3]) * 1e3,
                     ", whose CPU time counts on a CPU device" if self.cpu_device else "",
                     100 * BUDGET, "" if self.replica else ONE_NODE)
        return interval

    def close(self) -> None:
        self._settle()
        self._pool.shutdown(wait=True)
