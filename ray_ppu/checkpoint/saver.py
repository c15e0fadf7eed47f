"""Writing checkpoints: collective saves that are complete on every rank or not at all.

:class:`Saver` writes a run's checkpoints with ``megatron.core.dist_checkpointing``
(torch_dist format, the sharded state of :func:`_sharded_state`), synchronously or in a
background writer, and completes each one: every rank agrees every part was written
(:func:`_agree_saved`), then rank 0 writes the meta file that marks it complete. A save that
failed anywhere raises :class:`CheckpointSaveError` on every rank alike, after its partial
directory is gone, so training can go on and try again at the next save.

:func:`_sharded_state` lives here and serves :func:`ray_ppu.checkpoint.loading.load` too: a
load asks for exactly the state a save of the same layout writes. Megatron-Core and
torch.distributed.checkpoint are imported when a save runs, not with this module: the driver
imports this package and never saves.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import torch.distributed as dist

from ray_ppu.checkpoint import parts, processor
from ray_ppu.checkpoint.layout import META_FILE, Meta, _new_dir, config_hash
from ray_ppu.checkpoint.optimizer_workarounds import (
    _align_param_group_index_map,
    _materialize_optimizer_state,
)
from ray_ppu.checkpoint.rng import _rng_sharded
from ray_ppu.config.schema import RunConfig
from ray_ppu.data.sampler import consumed_samples
from ray_ppu.errors import CheckpointError
from ray_ppu.util.fs import atomic_write_text
from ray_ppu.util.wrappers import unwrap

# Megatron's DistributedOptimizer layout: every rank writes and reads its own contiguous
# buffer shards (no gather), and the shards are re-cut on load when DP changes. TP/PP changes
# need 'fully_reshardable' (gathers the state on DP rank 0 at save): not worth it for the
# elastic case, where only DP changes.
OPTIMIZER_FORMAT = "dp_reshardable"


def _sharded_state(model: list, optimizer, is_loading: bool, part: parts.Part = "all") -> dict:
    """Model chunks' and optimizer's sharded state dicts, keyed as Megatron-LM does; of the
    model, ``part`` (:mod:`ray_ppu.checkpoint.parts`: a LoRA run's checkpoints hold what trains,
    the optimizer's state is of that alone anyway)."""
    state: dict = {}
    if len(model) == 1:
        state["model"] = parts.sharded(unwrap(model[0]), part)
    else:  # virtual pipeline stages: each chunk knows its own layer offsets (vp_stage)
        for i, chunk in enumerate(model):
            state[f"model{i}"] = parts.sharded(unwrap(chunk), part)
    if optimizer is not None:
        _align_param_group_index_map(optimizer)
        _materialize_optimizer_state(optimizer)  # a fresh optimizer: loading, or iteration 0
        model_state = {k: v for k, v in state.items() if k.startswith("model")}
        state["optimizer"] = optimizer.sharded_state_dict(
            model_state, is_loading=is_loading,
            metadata={"distrib_optim_sharding_type": OPTIMIZER_FORMAT,
                      "chained_optim_avoid_prefix": True},
        )
    return state


class CheckpointSaveError(CheckpointError):
    """A save failed on some rank (full disk, storage gone): raised on every rank alike, after
    the partial directory is removed; training can go on and try again at the next save."""

    def __init__(self, message: str, iteration: int) -> None:
        super().__init__(message)
        self.iteration = iteration


def _write_error(err: BaseException) -> str:
    """One line per distinct cause: torch's CheckpointException (a BaseException) wraps each
    rank's write error with its traceback; the last line of each is what went wrong."""
    causes = getattr(err, "failures", None)
    if not causes:
        return f"{type(err).__name__}: {err}"
    lines = []
    for cause in causes.values():
        cause = cause[0] if isinstance(cause, tuple) else cause
        line = f"{type(cause).__name__}: {cause}".strip().splitlines()[-1]
        if line not in lines:
            lines.append(line)
    return "; ".join(lines)


def _agree_saved(path: Path, iteration: int, error: Optional[str]) -> None:
    """Every rank learns whether every rank wrote its part (torch's checkpoint writer already
    gathers write errors, but a rank can also fail outside it); on any failure rank 0 removes
    the partial directory (freeing what it took on a full disk) and all ranks raise alike."""
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = {rank: e for rank, e in enumerate(errors) if e is not None}
    if not failed:
        return
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    causes = list(dict.fromkeys(failed.values()))  # distinct, in rank order
    raise CheckpointSaveError(
        f"checkpoint at iteration {iteration} not saved: {len(failed)} of {len(errors)} ranks "
        f"failed to write {path} (rank {min(failed)}: {'; '.join(causes)[:500]})", iteration)


def _save_errors() -> tuple:
    """What a failed save raises: any Exception, and torch's CheckpointException (a
    BaseException). Imported when a save fails, not with this module: torch.distributed
    .checkpoint costs the driver 1.3 s, and the driver never saves."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


class Saver:
    """Writes a run's checkpoints; collective: every rank calls the same methods in order.

    Synchronous by default: :meth:`save` returns when the checkpoint is complete. With
    ``async_save`` (Megatron's async strategy) :meth:`save` only stages the state (on PPUs a
    copy to host memory; on the CPU a forked writer's copy-on-write view) and a background
    process writes it while training goes on; :meth:`poll`, after every iteration, completes
    the saves whose writers have all finished, :meth:`wait` all of them.

    Each method returns the checkpoints it completed, as ``(path, meta, tag)`` (``tag``: what
    the caller passed to :meth:`save`), or raises :class:`CheckpointSaveError` (on every rank
    alike) for one that failed.

    Completing a save: all ranks agree every part was written (else the directory goes and
    the error is raised), then rank 0 writes ``ray_ppu_meta.json`` (listing the files), the
    mark of a complete checkpoint, and a last agreement makes it complete everywhere.
    """

    def __init__(self, root: str | Path, plan, cfg: RunConfig, with_cuda_rng: bool = False,
                 async_save: bool = False, origin: Optional[dict] = None,
                 carried: Optional[dict] = None) -> None:
        self.root, self.plan, self.cfg = Path(root), plan, cfg
        self.origin = origin or {}
        # the tokenizer and image processor each checkpoint carries (rank 0 writes them)
        self.carried = carried or {}
        self.with_cuda_rng = with_cuda_rng
        self.queue = None
        if async_save:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self.queue = AsyncCallsQueue()
        # async call index → (path, iteration, tag, error (None), weights only)
        self.pending: dict[int, tuple] = {}
        # a run that never saves (checkpoint.enabled=false) spawns no writer queue
        if cfg.checkpoint.enabled:
            _start_writer_results_queue()


    def save(self, iteration: int, model: list, optimizer, scheduler, tag=None,
             on_dir: Optional[Callable[[Path], None]] = None,
             trained_only: bool = False) -> list[tuple]:
        """Start (async) or write (sync) the checkpoint after ``iteration`` iterations;
        ``on_dir`` is told the directory it writes as soon as it exists (the hang watchdog
        watches it grow). ``trained_only``: without an optimizer too, write what the run
        trains (a LoRA run's adapters) and record it as a training save does.

        1. Rank 0 creates a fresh ``iter_…`` directory; every rank learns its name.
        2. Every rank writes (or stages) its shards of model, optimizer and RNG states
           (torch_dist; replicated tensors spread over the DP ranks); rank 0 the common part.
           Without ``optimizer`` and ``scheduler``: the weights only (a conversion).
        3. Sync: complete it now. Async: complete it in a later :meth:`poll`.
        """
        from megatron.core import dist_checkpointing, parallel_state
        from megatron.core.dist_checkpointing.serialization import (
            get_default_save_sharded_strategy,
        )
        from megatron.core.dist_checkpointing.strategies.fully_parallel import (
            FullyParallelSaveStrategyWrapper,
        )

        path = _new_dir(self.root, iteration)
        if on_dir is not None:
            on_dir(path)
        # a conversion (no optimizer) writes every weight; a LoRA run what it trains
        weights_only = optimizer is None and not trained_only
        part = "all" if weights_only else parts.of_run(self.cfg)
        state = _sharded_state(model, optimizer, is_loading=False, part=part)
        state["iteration"] = iteration
        state["consumed_samples"] = consumed_samples(iteration, self.plan.global_batch_size)
        if scheduler is not None:
            state["scheduler"] = scheduler.state_dict()
            state["rng_state"] = _rng_sharded(self.with_cuda_rng)
        strategy = FullyParallelSaveStrategyWrapper(
            get_default_save_sharded_strategy("torch_dist"),
            parallel_state.get_data_parallel_group(with_context_parallel=True),
        )
        error = request = None
        try:  # a full disk, a lost mount: any write error (torch's is a BaseException)
            request = dist_checkpointing.save(state, str(path), sharded_strategy=strategy,
                                              async_sharded_save=self.queue is not None)
        except _save_errors() as err:
            error = _write_error(err)
        if self.queue is None or error is not None:
            return [self._complete(path, iteration, tag, error, weights_only)]
        self.pending[self.queue.schedule_async_request(request)] = (
            path, iteration, tag, None, weights_only)
        return []

    def poll(self, blocking: bool = False) -> list[tuple]:
        """Complete the background saves whose writers finished on every rank (all of them,
        waiting, with ``blocking``)."""
        if self.queue is None or not self.pending:
            return []
        try:
            finished = self.queue.maybe_finalize_async_calls(blocking=blocking)
        except _save_errors() as err:
            # Megatron finalizes in order and raises on every rank: the oldest one failed
            path, iteration, tag, _, weights_only = self.pending.pop(min(self.pending))
            return [self._complete(path, iteration, tag, _write_error(err), weights_only)]
        return [self._complete(*self.pending.pop(i)) for i in finished]

    def wait(self) -> list[tuple]:
        """Complete every background save (end of training)."""
        return self.poll(blocking=True)

    def in_flight(self) -> list[Path]:
        """The directories background saves are still writing."""
        return [entry[0] for entry in self.pending.values()]

    def _complete(self, path: Path, iteration: int, tag, error: Optional[str] = None,
                  weights_only: bool = False) -> tuple:
        if error is None and dist.get_rank() == 0:
            try:  # before the file list: a checkpoint missing them is damaged
                processor.write(path, self.carried)
            except OSError as err:
                error = f"{type(err).__name__}: {err}"
        _agree_saved(path, iteration, error)
        plan = self.plan
        meta = Meta(
            iteration=iteration,
            consumed_samples=consumed_samples(iteration, plan.global_batch_size),
            world_size=dist.get_world_size(),
            tensor_model_parallel_size=plan.tensor_model_parallel_size,
            pipeline_model_parallel_size=plan.pipeline_model_parallel_size,
            context_parallel_size=plan.context_parallel_size,
            data_parallel_size=plan.data_parallel_size,
            expert_model_parallel_size=plan.expert_model_parallel_size,
            expert_tensor_parallel_size=plan.expert_tensor_parallel_size,
            global_batch_size=plan.global_batch_size,
            config_hash=config_hash(self.cfg),
            optimizer_format=OPTIMIZER_FORMAT,
            saved_at=time.time(),
            files={f.relative_to(path).as_posix(): f.stat().st_size
                   for f in sorted(path.rglob("*")) if f.is_file()}
            if dist.get_rank() == 0 else None,
            weights_only=weights_only,
            model=dataclasses.asdict(self.cfg.model),
            lora=dataclasses.asdict(self.cfg.lora) if self.cfg.lora.enabled and not weights_only
            else None,
            vision=dataclasses.asdict(self.cfg.vision) if self.cfg.vision.enabled else None,
            **self.origin,
        )
        error = None
        if dist.get_rank() == 0:
            try:
                atomic_write_text(path / META_FILE, json.dumps(dataclasses.asdict(meta), indent=2))
            except OSError as err:
                error = f"{type(err).__name__}: {err}"
        _agree_saved(path, iteration, error)  # also the barrier: complete on every rank now
        return path, meta, tag


_WRITER_MANAGER = None  # the results queue's server, for the life of the process


def _start_writer_results_queue() -> None:
    """Make the queue Megatron-Core's torch_dist writer reports its results through, in a
    forked server process, before the first save.

    The writer makes it at the first save of a process (``filesystem_async.
    _get_write_results_queue``, kept for the process in ``_results_queue``): a
    ``multiprocessing`` Manager in a *spawned* server, a fresh interpreter that imports the
    main module again, and torch when it unpickles the first write results. That was the
    fixed cost of every process's first save: 5.6 s of the tiny preset's 6.3 s first save in
    one process, and in a Ray Train worker (whose main module, Ray's ``default_worker.py``,
    imports no torch) 4.96 s of a 7.6 s first save waiting on the server's torch import
    (cProfile; later saves 0.7-0.9 s). Started in the background it still cost a rank that
    CPU time, and its first save waited for it (5.5 s). A server forked from this process has
    every module already: 0.05 s. Megatron forks its writer processes from here at every
    save alike. The Saver is made before the model is built, so the server shares (copy on
    write) only the imported modules, about what a spawned server that imported torch holds;
    it exits with the rank (:func:`_exit_with_parent`). Nothing is done where this
    Megatron-Core keeps no such queue.
    """
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    global _WRITER_MANAGER
    if (getattr(filesystem_async, "_get_write_results_queue", None) is None
            or getattr(filesystem_async, "_results_queue", False) is not None):
        return
    _WRITER_MANAGER = SyncManager(ctx=multiprocessing.get_context("fork"))
    _WRITER_MANAGER.start(initializer=_exit_with_parent, initargs=(os.getpid(),))
    filesystem_async._results_queue = _WRITER_MANAGER.Queue()


def _exit_with_parent(parent: int) -> None:
    """In the forked queue server: exit once the rank that forked it is gone (SIGKILLed, or
    its node lost). A Manager server does not notice its parent's death by itself."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, name="ray_ppu-exit-with-parent", daemon=True).start()
