"""One training process: device → Megatron parallel state → model → optimizer → loop.

No Ray here: Ray Train (``ray_ppu.launch.launcher``) and plain torchrun (``entrypoints/torchrun_pretrain.py``)
both call :func:`train_rank` after creating the default process group.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import torch.distributed as dist

from ray_ppu import checkpoint, devices
from ray_ppu.model import parallel
from ray_ppu.monitor import restarts
from ray_ppu.config.schema import RunConfig
from ray_ppu.devices.specs import run_peak_tflops
from ray_ppu.monitor.metrics_log import MetricsWriter, SampleLog
from ray_ppu.plan import Plan
from ray_ppu.recovery.snapshot import MemoryPoint, Snapshotter, restore

log = logging.getLogger("ray_ppu")


def train_rank(
    cfg: RunConfig,
    plan: Plan,
    backend: devices.Backend,
    device_id: int,
    batches: Optional[Iterator[dict]],
    valid_batches: Optional[Iterator[dict]] = None,
    start_iteration: int = 0,
    resume: Optional[checkpoint.ResumePoint] = None,
    *,
    on_checkpoint: Optional[Callable[[Path, dict], None]] = None,
    failures: Sequence[restarts.Failure] = (),
    interruption: Optional[Callable[[int], Optional[str]]] = None,
    on_metrics: Optional[Callable[[dict], None]] = None,
    startup: Optional[dict] = None,
    snapshots: Optional[Snapshotter] = None,
    progress=None,
) -> dict:
    """Train this rank; returns the last logged metrics (identical on every rank).

    ``start_iteration`` is the first iteration ``batches`` delivers; with ``resume`` the loaded
    checkpoint must be at that iteration. Checkpoints go to ``checkpoint.save_root(cfg)``;
    ``on_checkpoint(path, metrics)`` runs on every rank once one is complete (Ray Train reports
    it); without it rank 0 keeps the last ``checkpoint.keep_last`` itself (torchrun). A save
    that fails (full disk) is logged and counted, and training goes on. ``failures``: this
    launch's earlier worker-group failures (this group is a restart when there are any).
    ``interruption(iteration)``: asked after every iteration on every rank, the same answer on
    all: None, ``"save"`` (a node is being drained) or ``"stop"`` (the job is being stopped).
    ``on_metrics(row)``: every logged row, on every rank (Ray's metrics export).
    ``resume``: a disk checkpoint or an in-memory snapshot (``ray_ppu.recovery.snapshot.MemoryPoint``);
    ``snapshots``: takes this rank's in-memory snapshots after the iterations (Ray only).
    ``progress``: told of every iteration and save (``ray_ppu.recovery.watchdog.Beacon``).
    ``startup``: seconds per start-up phase so far (the launcher's); rank 0 of a first group
    adds the model build, the first batch's wait and the first step, and logs them once, after
    the first training row (a ``start`` row in metrics.jsonl and a ``start: …`` line).

    1. Bind the device (PPU id, or the CPU shim) for this thread.
    2. Megatron parallel groups and seeds on the existing process group.
    3. GPTModel chunks in Megatron DDP; Megatron optimizer and LR schedule.
    4. Load ``resume`` (weights, optimizer, schedule, RNG); check it starts where the data does.
       Without one, the Hugging Face weights of ``checkpoint.pretrained``, if set (each rank
       reads its own slices).
    5. The loop, saving every ``checkpoint.save_interval`` iterations, at the end and when
       interrupted (in the background with ``checkpoint.async_save``: completed after later
       iterations, all before returning); rank 0 writes metrics.jsonl (training, validation,
       checkpoint and restart rows), TensorBoard and the progress line; data-reading ranks
       write their sample log when asked.
    6. Tear down the parallel groups (the process group belongs to the caller).
    """
    from ray_ppu.model.gpt import build_model, packed_format
    from ray_ppu.model.optim import build_optimizer
    from ray_ppu.train.loop import TrainState, train
    from ray_ppu.train.moe_metrics import expert_load

    duties = _RankDuties(cfg, plan, backend, batches, start_iteration, resume, failures, startup,
                         on_checkpoint=on_checkpoint, interruption=interruption,
                         on_metrics=on_metrics, snapshots=snapshots, progress=progress)
    with devices.bound(backend, device_id):
        parallel.initialize(plan, cfg.training.seed)
        try:
            # random weights only where nothing is loaded over them (LoRA: a base always is)
            model, config = build_model(cfg, plan, backend, initialize=resume is None
                                        and not cfg.checkpoint.pretrained
                                        and not cfg.lora.enabled)
            optimizer, scheduler = build_optimizer(cfg, plan, model)
            if cfg.lora.enabled:
                _load_base(cfg, plan, model, fresh=resume is None, rank0=duties.rank0)
            _load_state(cfg, plan, resume, start_iteration, model, optimizer, scheduler,
                        duties.rank0, duties.saver.origin.get("base"))
            device = devices.torch_device(backend)
            state = TrainState(plan, model, optimizer, scheduler, device,
                               expert_load=expert_load(model, config, device),
                               images=_image_spec(cfg))
            duties.model_ready(state)
            final = train(state, batches, duties.hooks(), start_iteration=start_iteration,
                          valid_batches=valid_batches, log_interval=cfg.training.log_interval,
                          save_interval=cfg.checkpoint.save_interval,
                          packed=packed_format(cfg, plan, backend),
                          profiler=duties.profiler())
            return duties.finish(final)
        finally:
            duties.close()
            parallel.destroy()


class _RankDuties:
    """This rank's side of the loop's hooks: its rows (metrics.jsonl, TensorBoard and the
    progress line on rank 0; Ray's export on every rank), its saves (started, polled, reported,
    kept), and its per-iteration work (snapshots, watchdog progress, sample log, the restart
    row, the interruption question). One object, so :func:`train_rank` reads top-down."""

    def __init__(self, cfg: RunConfig, plan: Plan, backend: devices.Backend, batches,
                 start_iteration: int, resume,
                 failures: Sequence[restarts.Failure], startup: Optional[dict], *,
                 on_checkpoint, interruption, on_metrics, snapshots, progress) -> None:
        self.cfg, self.plan, self.batches = cfg, plan, batches
        self.start_iteration, self.resume, self.failures = start_iteration, resume, failures
        self.startup = startup
        self.on_checkpoint, self.interruption, self.on_metrics = on_checkpoint, interruption, on_metrics
        self.snapshots, self.progress = snapshots, progress
        self.rank0 = dist.get_rank() == 0
        self.backend, self.kernels = backend, None
        self.writer = MetricsWriter(cfg.output.dir, cfg.output.tensorboard) if self.rank0 else None
        self.samples = None
        if cfg.output.sample_log and batches is not None:
            self.samples = SampleLog(cfg.output.dir, dist.get_rank(),
                                     plan.dims.coordinates(dist.get_rank())["dp"],
                                     plan.data_parallel_size)
        self.counts = {"restarts": len(failures), "checkpoint_failures": 0}
        self.restart_pending = bool(failures)
        self.peak = run_peak_tflops(cfg.cluster, backend)  # None: unknown (CPU), MFU n/a
        self.logged: dict = {}  # the last training row as logged: the final result carries it
        self.timeline = {"entered": time.perf_counter()}
        self.root = checkpoint.save_root(cfg)
        origin = (resume.origin if isinstance(resume, MemoryPoint)
                  else checkpoint.origin(cfg, resume))
        self.saver = checkpoint.Saver(self.root, plan, cfg, with_cuda_rng=backend == "ppu",
                                      async_save=cfg.checkpoint.async_save, origin=origin,
                                      carried=_carried(cfg, origin) if self.rank0 else None)
        self.state = None

    def hooks(self):
        from ray_ppu.train.loop import Hooks

        return Hooks(on_log=self.on_log, on_iteration=self.on_iteration,
                     on_save=self.on_save if self.cfg.checkpoint.enabled else None,
                     on_iteration_done=self.on_iteration_done)

    def on_iteration_done(self, done: int) -> None:
        """After the iteration's validation, before its save: its in-memory snapshot (a group
        restored from it starts after that validation, as from a checkpoint of the iteration)."""
        if self.snapshots is not None:
            s = self.state
            self.snapshots.after(done, s.model, s.optimizer, s.scheduler)

    def profiler(self):
        """``output.profile_iters`` on rank 0: the step profiler (None: not profiling)."""
        if not (self.rank0 and self.cfg.output.profile_iters):
            return None
        from ray_ppu.monitor.step_profile import StepProfiler

        return StepProfiler(self.cfg.output.dir, self.cfg.output.profile_iters,
                            self.cfg.output.profile_start)

    def model_ready(self, state) -> None:
        self.state = state
        if self.rank0:  # after the load: the resume decision was made before this group began
            checkpoint.remove_incomplete(self.root)
            self.kernels = worker_kernel_names(self.cfg, self.backend, state.device)
            log.info("kernels: %s", ", ".join(f"{k} {v}" for k, v in self.kernels.items()))
        self.timeline["model_ready"] = time.perf_counter()

    def on_log(self, metrics: dict) -> None:
        if "lm_loss" in metrics:
            # training rows say the group's shape too: an elastic group changes it
            mfu = metrics["tflops_per_device"] / self.peak if self.peak else None
            metrics = {**metrics, "mfu": mfu,
                       "restarts": self.counts["restarts"], "world_size": self.plan.world_size,
                       "data_parallel_size": self.plan.data_parallel_size}
            if self.snapshots is not None and self.snapshots.blocking_s:  # the latest one
                metrics.update(snapshot_blocking_s=self.snapshots.blocking_s[-1],
                               snapshot_interval=self.snapshots.interval)
            self.logged.update(metrics)
        if self.writer is not None:
            self.writer.write(metrics)
            if "lm_loss" in metrics and self.startup is not None and not self.failures:
                _log_startup(self.writer, metrics["iteration"], self.startup, self.timeline,
                             self.batches, self.resume, self.kernels)
                self.startup = None  # once: the start row follows the first training row
        if self.on_metrics is not None:  # every rank: its own throughput, memory, data wait
            self.on_metrics(metrics)

    def on_iteration(self, done: int, sample_ids: Optional[list]) -> Optional[str]:
        self.timeline.setdefault("first_step_done", time.perf_counter())
        self.saving(self.saver.poll)  # background saves whose writers finished
        if self.progress is not None:
            self.progress.after(done)
        if self.samples is not None and sample_ids is not None:
            self.samples.write(done, sample_ids)
        if self.restart_pending and self.writer is not None:  # a restarted group's first one
            self.writer.write(self._restart_row())
        self.restart_pending = False
        action = self.interruption(done) if self.interruption is not None else None
        if action and self.writer is not None:
            self.writer.write({"event": "interrupted", "iteration": done,
                               "reason": "job stop" if action == "stop" else "node drain"})
        return action

    def _restart_row(self) -> dict:
        resume = self.resume
        return restarts.restart_row(
            list(self.failures), self.start_iteration, Path(resume.path).name if resume else None,
            self.writer.dir / "metrics.jsonl", time.time(),
            restored_from=None if resume is None
            else "memory" if isinstance(resume, MemoryPoint) else "disk")

    def on_save(self, iteration: int, metrics: dict) -> None:
        tag = {"metrics": metrics, "started": time.perf_counter(), "blocked_s": None}
        s, progress = self.state, self.progress
        # a save may take longer than an iteration: the watchdog watches its directory grow
        on_dir = (lambda path: progress.saving([path])) if progress is not None else None
        self.saving(lambda: self.saver.save(iteration, s.model, s.optimizer, s.scheduler,
                                            tag=tag, on_dir=on_dir))
        if progress is not None:
            progress.saved()
        # async: the state is staged and training goes on (sync: already complete)
        tag["blocked_s"] = time.perf_counter() - tag["started"]

    def saving(self, step: Callable[[], list]) -> None:
        """Run a save step (start, poll, wait); log, report and keep what it completed,
        or log and count a failed save (the same on every rank)."""
        try:
            completed = step()
        except checkpoint.CheckpointSaveError as err:
            self.counts["checkpoint_failures"] += 1
            self.on_log({"event": "checkpoint_failed", "iteration": err.iteration,
                         "error": str(err), **self.counts})
            return
        for path, meta, tag in completed:
            took = time.perf_counter() - tag["started"]
            self.on_log({"event": "checkpoint", "iteration": meta.iteration,
                         "checkpoint": path.name, "path": str(path), "checkpoint_time_s": took,
                         # what training waited: all of it, unless checkpoint.async_save
                         "save_blocking_s": tag["blocked_s"] or took})
            if self.on_checkpoint is not None:
                self.on_checkpoint(path, tag["metrics"])
            elif self.rank0:
                checkpoint.prune(self.root, self.cfg.checkpoint.keep_last)

    def finish(self, final: dict) -> dict:
        """Background saves finish (and are reported) before the result is returned."""
        if self.progress is not None and self.saver.in_flight():
            self.progress.saving(self.saver.in_flight())
        self.saving(self.saver.wait)
        if self.progress is not None:
            self.progress.saved()
        return {**self.logged, **final, **self.counts}

    def close(self) -> None:
        if self.snapshots is not None:
            self.snapshots.close()
        for out in (self.writer, self.samples):
            if out is not None:
                out.close()


def _load_base(cfg: RunConfig, plan: Plan, model: list, fresh: bool, rank0: bool) -> None:
    """A LoRA run's frozen base, at every start (its checkpoints and snapshots hold what
    trains): the Hugging Face weights of ``checkpoint.pretrained`` or the weights of the
    ``checkpoint.load`` checkpoint; for a fresh run then the adapters of ``lora.adapter``."""
    started = time.perf_counter()
    if cfg.checkpoint.pretrained:
        from ray_ppu.hf import pretrained

        pretrained.load(model, cfg, plan.padded_vocab_size)
    else:
        _, path = checkpoint.base.base_dir(cfg)
        base = checkpoint.ResumePoint(str(path), checkpoint.read_meta(path), weights_only=True)
        checkpoint.load(base, model, None, None, plan, cfg)
    if fresh and cfg.lora.adapter:
        from ray_ppu.hf.peft import load_into, read_adapter

        load_into(model, read_adapter(cfg.lora.adapter), cfg.model, cfg.lora, cfg.vision)
    if rank0:
        log.info("LoRA base %s%s loaded in %.1f s", cfg.checkpoint.pretrained or cfg.checkpoint.load,
                 f", adapters from {cfg.lora.adapter}" if fresh and cfg.lora.adapter else "",
                 time.perf_counter() - started)


def _load_state(cfg: RunConfig, plan: Plan, resume, start_iteration: int, model: list,
                optimizer, scheduler, rank0: bool, base: Optional[dict] = None) -> None:
    """Where the group starts: an in-memory snapshot, a disk checkpoint (both checked against
    the data stream's first iteration), or for a fresh run ``checkpoint.pretrained`` (a LoRA
    run's base is loaded already: its optimizer takes the adapters as they are now)."""
    if resume is None and cfg.lora.enabled:
        optimizer.reload_model_params()  # main copies of the adapters as drawn or imported
        return
    if resume is None:
        if cfg.checkpoint.pretrained:
            from ray_ppu.hf import pretrained

            took = pretrained.load(model, cfg, plan.padded_vocab_size)
            optimizer.reload_model_params()  # its fp32 main copies still hold the init
            if rank0:
                log.info("loaded Hugging Face weights from %s in %.1f s (rank 0 read %.2f GB)",
                         cfg.checkpoint.pretrained, took["seconds"], took["bytes_read"] / 1e9)
        return
    started = time.perf_counter()
    if isinstance(resume, MemoryPoint):
        loaded = restore(resume, model, optimizer, scheduler)
    else:
        loaded = checkpoint.load(resume, model, optimizer, scheduler, plan, cfg, base)
    if loaded != start_iteration:  # the data would not be the data of that point
        raise checkpoint.CheckpointError(
            f"loaded {resume.path} at iteration {loaded}, but the data stream starts at "
            f"iteration {start_iteration}")
    if rank0:
        log.info("loaded %s%s in %.1f s: training continues at iteration %d", resume.path,
                 " (weights only)" if resume.weights_only else "",
                 time.perf_counter() - started, loaded)


def _log_startup(writer: MetricsWriter, iteration: int, startup: dict, timeline: dict,
                 batches, resume, kernels: Optional[dict]) -> None:
    """The ``start`` row and its ``start:`` line: each start-up phase once, in the order they
    ran (the first step includes the wait for the first batch), where the state came from
    (``resumed_from``: a checkpoint's name, ``memory:<nodes>``, or None from scratch) and the
    kernels the layers run (:func:`worker_kernel_names`)."""
    phases = {**startup,
              "model": timeline["model_ready"] - timeline["entered"],
              "first batch": getattr(batches, "first_wait_s", None) or 0.0,
              "first step": timeline["first_step_done"] - timeline["model_ready"]}
    writer.write({"event": "start", "iteration": iteration,
                  "resumed_from": Path(resume.path).name if resume else None, "phases_s": phases,
                  "kernels": kernels})


def worker_kernel_names(cfg: RunConfig, backend: devices.Backend, device) -> dict:
    """What this worker's layers compute with (:mod:`ray_ppu.plan.kernels`), with the packed
    rows' torch kernel as it runs here (varlen flash attention, or one SDPA call per sample)."""
    from dataclasses import asdict

    from ray_ppu.model.gpt import worker_kernels

    kernels = {k: v for k, v in asdict(worker_kernels(cfg, backend)).items() if v}
    if kernels.get("packed") == "thd" and kernels["attention"] == "sdpa":
        import torch

        from ray_ppu.model.attention import packed_kernel
        from ray_ppu.model.megatron_settings import PARAMS_DTYPE

        dtype = getattr(torch, PARAMS_DTYPE[cfg.training.precision])
        kernels["packed"] = f"thd ({packed_kernel(torch.empty(0, device=device, dtype=dtype))})"
    return kernels


def _image_spec(cfg: RunConfig):
    """A vision-language run's ImageSpec (how the rank normalises its images); None for text."""
    if not cfg.vision.enabled:
        return None
    from ray_ppu.data.sft.image_samples import vision_data

    return vision_data(cfg).spec


def _carried(cfg: RunConfig, origin: dict) -> dict:
    """What the run's checkpoints carry to be used on their own: its tokenizer, generation
    config and image processor (:mod:`ray_ppu.checkpoint.processor`)."""
    if not cfg.checkpoint.enabled:
        return {}
    from ray_ppu.checkpoint.processor import gather
    from ray_ppu.data.sft.image_samples import processor_file

    return gather(cfg, origin.get("hf_source"), processor_file(cfg))
