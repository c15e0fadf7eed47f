"""The driver side: Ray cluster, preflight checks, and the Ray Train TorchTrainer.

The only module (with ``ray_ppu.data.ray_stream``) that imports Ray. Workers run
:func:`_train_worker`, which adapts Ray Train (dataset shard, PPU id, reports) to the Ray-free
:func:`ray_ppu.worker.run`.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import logging
import math
import os
import signal
import socket
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Optional

import ray
import ray.train
import torch
import torch.distributed as dist
from ray.train import FailureConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from ray_ppu import checkpoint, devices, recovery
from ray_ppu.config.loader import ConfigError
from ray_ppu.config.schema import RunConfig
from ray_ppu.data import idxmap, sft_store
from ray_ppu.data.order import valid_steps
from ray_ppu.data.ray_stream import IdxmapDataConfig, steps_dataset
from ray_ppu.plan import ParallelDims, Plan, plan_for_world

log = logging.getLogger("ray_ppu")

# Ray's default list of accelerator resources whose units get instance ids, plus PPU: with this
# in the raylet's environment, Ray hands each worker distinct PPU ids (DESIGN.md §4).
UNIT_INSTANCE_RESOURCES = "neuron_cores,TPU,NPU,HPU,RBLN,FURIOSA,TTNPU,MBLT,PPU"


_START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"
_ENV_AT_IMPORT = frozenset(os.environ)


class ClusterError(RuntimeError):
    """The cluster cannot run the requested job (found before any worker is placed)."""


def connect(cfg: RunConfig) -> bool:
    """Join the cluster in RAY_ADDRESS (as under ``ray job submit``), else start a local Ray.

    The local Ray advertises simulated PPUs (``cluster.simulated_ppus``, default: as many as
    the run needs) with per-unit ids. Returns True when this call started Ray.
    """
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(log_to_driver=True)
        return False
    os.environ.setdefault("RAY_custom_unit_instance_resources", UNIT_INSTANCE_RESOURCES)
    c = cfg.cluster
    ppus = c.simulated_ppus or int(c.num_workers * c.ppu_per_worker)
    # Logical CPUs: the workers' own plus every reader actor's (reading ranks × splits ×
    # reader_actors × reader_cpus) plus one for Ray Data's own tasks; the OS shares the cores.
    # Too few and a reader actor waits for a CPU forever while its rank waits for data.
    p, d = cfg.parallel, cfg.data
    dims = ParallelDims(c.num_workers, p.tensor_model_parallel_size,
                        p.pipeline_model_parallel_size, p.context_parallel_size)
    splits = 2 if cfg.training.eval_iters else 1
    readers = len(list(dims.data_ranks())) * splits * d.reader_actors * d.reader_cpus
    cpus = max(os.cpu_count() or 1, math.ceil(c.num_workers * c.cpus_per_worker + readers) + 1)
    # address="local": a new Ray even when `ray start` left a cluster on this machine
    ray.init(address="local", num_cpus=cpus, resources={c.resource_name: ppus}, log_to_driver=True)
    return True


def check_capacity(cfg: RunConfig) -> None:
    """Fail at once, with what each node has, if the cluster lacks the PPUs for this run."""
    c = cfg.cluster
    workers = c.min_workers or c.num_workers  # elastic: the run starts with what fits
    need = workers * c.ppu_per_worker
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    per_node = {n["NodeManagerAddress"] + "/" + n["NodeID"][:8]: n["Resources"].get(c.resource_name, 0)
                for n in nodes}
    have = sum(per_node.values())
    fits = sum(int(v // c.ppu_per_worker) for v in per_node.values()) if c.ppu_per_worker else workers
    if have < need or fits < workers:
        listing = ", ".join(f"{k}: {v:g}" for k, v in per_node.items()) or "no alive nodes"
        raise ClusterError(
            f"the run needs {workers} workers × {c.ppu_per_worker:g} {c.resource_name} = "
            f"{need:g} {c.resource_name}, but the cluster has {have:g} ({listing}); "
            f"lower cluster.num_workers or add nodes started with --resources='{{\"{c.resource_name}\": 16}}'"
        )


@ray.remote(num_cpus=1)
def _prepare_index(spec: idxmap.SampleSpec) -> dict[str, int]:
    return idxmap.prepare(spec)


def assigned_device_id(resource_name: str) -> int:
    """The PPU id Ray assigned this worker; LOCAL_RANK (with a warning) when Ray has none."""
    ids: list = []
    try:  # private API (DESIGN.md §4): ids exist only when the raylet knows PPU as a unit resource
        worker = ray._private.worker.global_worker
        ids = worker.get_accelerator_ids_for_accelerator_resource(
            resource_name, rf"^{resource_name}_group_[0-9A-Za-z]+$"
        )
    except Exception as err:  # pragma: no cover - depends on Ray internals
        log.debug("no %s ids from Ray: %s", resource_name, err)
    if ids:
        return int(ids[0])
    local_rank = ray.train.get_context().get_local_rank()
    log.warning(
        "Ray assigned no %s ids to this worker (start raylets with "
        "RAY_custom_unit_instance_resources including %s); using local rank %d",
        resource_name, resource_name, local_rank,
    )
    return local_rank


def _quiet_worker_logs() -> None:
    """Our progress lines once each; Ray Train's per-report INFO lines and Megatron's
    per-parameter listings off (they drown the progress report in the job log)."""
    ours = logging.getLogger("ray_ppu")
    if not ours.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False
    from ray.train.v2._internal.execution import context as train_context

    # Ray Train logs every report at INFO under its file's path as the logger name.
    for name in ("ray.train", "megatron.core", train_context.__file__):
        logging.getLogger(name).setLevel(logging.WARNING)
    # Megatron's "Apex/TE not installed, falling back" and torch's c10d deprecation notices
    # repeat on every rank; they say nothing the run can act on.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed\.")


def _train_worker(payload: dict) -> dict:
    """Ray Train's train_loop_per_worker: adapt Ray to :func:`ray_ppu.worker.run`."""
    from ray_ppu import worker

    _quiet_worker_logs()
    cfg: RunConfig = payload["cfg"]
    backend: devices.Backend = payload["backend"]
    token: str = payload["token"]
    context = ray.train.get_context()
    world = context.get_world_size()
    # An elastic group can be smaller than planned, and any size: the workers past the last
    # whole model replica (or past a DP size that divides the global batch) stay spare.
    plan: Plan = payload["plan"] if world == payload["plan"].world_size else plan_for_world(cfg, world)
    if context.get_world_rank() == 0 and world != cfg.cluster.num_workers:
        log.warning("worker group of %d (of %d planned): TP %d × CP %d × PP %d × DP %d = %d train "
                    "with %d microbatches per rank, %d spare", world, cfg.cluster.num_workers,
                    plan.tensor_model_parallel_size, plan.context_parallel_size,
                    plan.pipeline_model_parallel_size, plan.data_parallel_size, plan.world_size,
                    plan.num_microbatches, plan.spare_workers)

    def stream(split: str):  # None on ranks that read no data
        shard = ray.train.get_dataset_shard(split)
        if shard is None:
            return None
        return iter(shard.iter_batches(batch_size=plan.micro_batch_size, batch_format="numpy",
                                       prefetch_batches=cfg.data.prefetch_batches))

    # Where this group starts: the decision the dataset factories made moments ago in the
    # controller, made again here from the same files, and checked against their record
    # (ray_ppu.checkpoint's docstring: the two must agree or the data would be misaligned).
    resume = checkpoint.resume_point(cfg)
    start_iteration = checkpoint.check_stream_start(cfg, token, resume)
    _check_against_ray(cfg, resume)
    if plan.spare_workers and not _leave_spares_out(plan.world_size):
        return _idle_as_spare(cfg, token, start_iteration)
    batches = stream("train")
    valid_batches = stream("valid") if plan.eval_iters else None
    # As many compute threads as CPUs Ray reserved for this worker (torchrun sets
    # OMP_NUM_THREADS=1 likewise); torch's default, every core, oversubscribes the node.
    torch.set_num_threads(max(1, int(cfg.cluster.cpus_per_worker)))
    device_id = assigned_device_id(cfg.cluster.resource_name) if backend == "ppu" else 0
    # No ray.train.report per log line: Ray Train drains one report per health-check interval
    # (2 s), so frequent reports would throttle training. Metrics go to metrics.jsonl and
    # TensorBoard; the final metrics come back as the run's return value. Checkpoints are
    # reported (save points only), so Ray Train knows them and deletes the oldest.
    root = checkpoint.save_root(cfg)
    interruption = _Interruptions(root / f"{_STOP}{token}", backend,
                                  # get_preemption_info is a barrier over every worker, and the
                                  # spares do not follow the iterations
                                  watch_preemption=cfg.checkpoint.save_on_preemption
                                  and not plan.spare_workers)
    final = worker.run(cfg, plan, backend, device_id, batches, valid_batches, start_iteration,
                       resume, on_checkpoint=_report_checkpoint,
                       failures=recovery.failures(root, token), interruption=interruption)
    if plan.spare_workers and context.get_world_rank() == 0:  # the spares may go now
        (checkpoint.save_root(cfg) / f"{_FINISHED}{token}").touch()
    return {**final, "world_size": plan.world_size, "spare_workers": plan.spare_workers}


_FINISHED = "finished_"  # + launch token: the active ranks are done (spares stop waiting)
_STOP = "stop_"  # + launch token: the driver asks the workers to save and stop


class _Interruptions:
    """``worker.run``'s ``interruption``: asked after every iteration on every training rank.

    "stop" when the driver has asked the run to stop (its stop file, looked at by rank 0);
    "save" when Ray Train reports that a node of the run is being drained (asked as often as
    Ray Train's drain watcher looks, RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S, default 5 s; once per
    drain). One all-reduce of two flags gives every rank the same answer.
    """

    def __init__(self, stop_file: Path, backend: devices.Backend, watch_preemption: bool) -> None:
        self.stop_file, self.backend = stop_file, backend
        self.watch_preemption = watch_preemption
        self.poll_s = float(os.environ.get("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", 5.0))
        self.last_poll = time.monotonic()

    def __call__(self, iteration: int) -> Optional[str]:
        rank0 = dist.get_rank() == 0
        poll = (rank0 and self.watch_preemption
                and time.monotonic() - self.last_poll >= self.poll_s)
        flags = torch.tensor([float(rank0 and self.stop_file.exists()), float(poll)],
                             device=devices.torch_device(self.backend))
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop, poll = bool(flags[0]), bool(flags[1])
        if poll:  # every rank calls it: Ray Train agrees on one answer across the workers
            self.last_poll = time.monotonic()
            info = ray.train.get_preemption_info()
            if info is not None:
                self.watch_preemption = False  # one checkpoint per drain
                if rank0:
                    left = (f", {info.deadline_ms / 1000 - time.time():.0f} s before the "
                            f"deadline" if info.deadline_ms else "")
                    log.warning("nodes %s (ranks %s) are being drained%s",
                                [n[:8] for n in info.preempted_node_ids], info.preempted_ranks,
                                left)
                return "stop" if stop else "save"
        return "stop" if stop else None


class _GracefulStop:
    """The driver's SIGTERM (``ray job stop``): once training runs, ask the workers to save
    and stop (a file they watch), and abort them if that takes longer than ``timeout_s`` or a
    second signal comes; before training starts, abort at once."""

    def __init__(self, stop_file: Path, timeout_s: float) -> None:
        self.stop_file, self.timeout_s = stop_file, timeout_s
        self.training = self.requested = False

    def __call__(self, *_) -> None:
        if not self.training or self.requested:
            signal.raise_signal(signal.SIGINT)  # Ray Train's abort (KeyboardInterrupt before)
            return
        self.requested = True
        self.stop_file.parent.mkdir(parents=True, exist_ok=True)
        self.stop_file.touch()
        log.warning("stop requested: the workers save a checkpoint after their current iteration "
                    "and stop (aborted after %g s or on a second signal)", self.timeout_s)
        timer = threading.Timer(self.timeout_s, lambda: os.kill(os.getpid(), signal.SIGINT))
        timer.daemon = True
        timer.start()


def _leave_spares_out(active: int) -> bool:
    """Re-form the default process group from world ranks ``0 .. active-1`` only (Megatron's
    groups are cut from the default group's size); True on those ranks, False on spares.

    The new rendezvous port is chosen by rank 0 and shared over a gloo group (with NCCL the
    default group would need a bound device, which comes later).
    """
    rank = dist.get_rank()
    port = [_free_port() if rank == 0 else None]
    dist.broadcast_object_list(port, src=0, group=dist.new_group(backend="gloo"))
    backend = dist.get_backend()
    dist.destroy_process_group()
    if rank >= active:
        return False
    dist.init_process_group(backend, init_method=f"tcp://{os.environ['MASTER_ADDR']}:{port[0]}",
                            rank=rank, world_size=active, timeout=datetime.timedelta(minutes=30))
    return True


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _idle_as_spare(cfg: RunConfig, token: str, start_iteration: int) -> dict:
    """A spare worker's whole job: join every checkpoint report of the active ranks (Ray
    Train's report is a barrier over all workers of the group) until they finish."""
    root = checkpoint.save_root(cfg)
    reported = start_iteration  # complete checkpoints up to here predate this group
    while True:
        finished = (root / f"{_FINISHED}{token}").exists()  # read first: then the last report
        for path, meta in checkpoint.complete_checkpoints(root, warn=False):  # is seen below
            if meta.iteration > reported:
                _report_checkpoint(path, {"iteration": meta.iteration}, rank0=False)
                reported = meta.iteration
        if finished:
            return {}
        time.sleep(0.5)


class FailureRecorder(ray.train.UserCallback):
    """Runs in the Ray Train controller: writes down each worker-group failure (cause, ranks,
    time) for the next group's rank 0 to report as a restart (ray_ppu.recovery)."""

    def __init__(self, root: Path, token: str) -> None:
        self.root, self.token = root, token

    def after_exception(self, run_context, worker_exceptions: dict) -> None:
        failure = recovery.record_failure(self.root, self.token, worker_exceptions)
        log.warning("worker group failed (%s); Ray Train restarts it if "
                    "cluster.max_failures allows", failure.cause)


def _report_checkpoint(path: Path, metrics: dict, rank0: Optional[bool] = None) -> None:
    """Register a complete checkpoint with Ray Train; every rank calls it (report is a barrier).

    The checkpoint is one directory all ranks wrote into, already inside Ray Train's run
    directory (checkpoint.save_root): only rank 0 names it, and NO_UPLOAD registers it where it
    is instead of copying it (Ray 2.60 accepts that only for directories under the run's
    storage path, and requires every rank that names a checkpoint to name the same path).
    """
    if rank0 is None:
        rank0 = ray.train.get_context().get_world_rank() == 0
    ray.train.report(
        {**metrics, "checkpoint": path.name},
        checkpoint=ray.train.Checkpoint.from_directory(str(path)) if rank0 else None,
        checkpoint_dir_name=path.name,
        checkpoint_upload_mode=ray.train.CheckpointUploadMode.NO_UPLOAD,
    )


def _check_against_ray(cfg: RunConfig, resume) -> None:
    """Our save root must be Ray Train's run directory (or Ray would not register our
    checkpoints); and say so when Ray's latest registered checkpoint is not the one we load."""
    storage = ray.train.get_context().get_storage()
    ray_dir = Path(storage.experiment_fs_path).resolve()
    if ray_dir != checkpoint.save_root(cfg):
        raise checkpoint.CheckpointError(f"Ray Train's run directory {ray_dir} is not the "
                                         f"checkpoint root {checkpoint.save_root(cfg)}")
    registered = ray.train.get_checkpoint()
    if registered is not None and (resume is None
                                   or Path(registered.path).resolve() != Path(resume.path)):
        # Ray's is newer but incomplete (no meta file), or ours is newer than Ray's (the group
        # died between writing it and Ray registering it): the complete one on disk wins.
        log.warning("Ray Train's latest checkpoint is %s; starting from the latest complete "
                    "one, %s", registered.path, resume.path if resume else "none (from scratch)")


def build_trainer(cfg: RunConfig, plan: Plan, backend: devices.Backend,
                  spec: idxmap.SampleSpec, token: str = "") -> TorchTrainer:
    """TorchTrainer with one worker per PPU, the idxmap stream, checkpoints and the failure
    policy. ``token`` identifies this launch in the stream-start record (checkpoint.py)."""
    c = cfg.cluster
    root = checkpoint.save_root(cfg)
    # The streams start where the checkpoint the workers will load ends: Ray Train calls these
    # factories at every (re)start of the worker group, and they read it from disk then.
    start = functools.partial(checkpoint.stream_start, cfg, plan.eval_interval, plan.eval_iters,
                              token)
    datasets = {"train": steps_dataset(plan.train_iters, start=functools.partial(start, "train"))}
    if plan.eval_iters:
        datasets["valid"] = steps_dataset(valid_steps(plan), start=functools.partial(start, "valid"))
    return TorchTrainer(
        _train_worker,
        train_loop_config={"cfg": cfg, "plan": plan, "backend": backend, "token": token},
        # Explicit: TorchConfig(backend=None) would pick gloo for a custom resource like PPU.
        torch_config=TorchConfig(backend=devices.dist_backend(backend)),
        scaling_config=ScalingConfig(
            # elastic: Ray Train restarts the group on whatever fits between the two
            num_workers=(c.min_workers, c.num_workers) if c.min_workers else c.num_workers,
            elastic_resize_monitor_interval_s=c.elastic_resize_interval_s,
            use_gpu=False,  # PPUs are a custom resource; binding is ours (assigned_device_id)
            resources_per_worker={c.resource_name: c.ppu_per_worker, "CPU": c.cpus_per_worker},
        ),
        run_config=ray.train.RunConfig(
            name=root.name,
            storage_path=str(root.parent),  # checkpoints are written straight into <this>/<name>
            failure_config=FailureConfig(max_failures=c.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.checkpoint.keep_last),
            callbacks=[FailureRecorder(root, token)],
        ),
        datasets=datasets,
        dataset_config=IdxmapDataConfig(
            spec,
            plan.tensor_model_parallel_size,
            plan.pipeline_model_parallel_size,
            plan.context_parallel_size,
            plan.global_batch_size,
            plan.micro_batch_size,
            cfg.data.reader_cpus,
            cfg.data.reader_actors,
        ),
    )


def launch(cfg: RunConfig, plan: Plan) -> dict:
    """Run the job on Ray; returns rank 0's last logged metrics.

    1. Check the corpora on the driver (files, headers, sizes, token ids, splits).
    2. Checkpoint settings; say where the run starts (its own latest complete checkpoint,
       ``checkpoint.load``, or scratch). The workers decide again at every (re)start.
    3. Connect to the cluster (or start a local Ray with simulated PPUs); enough PPU?
    4. Build Megatron's sample indices once, in one Ray task, into the shared cache.
    5. TorchTrainer.fit(): one worker per PPU, each joining the Megatron worker group.
    6. SIGTERM (``ray job stop``): the workers save after their iteration and stop; Ctrl-C,
       a second signal or ``checkpoint.stop_timeout_s`` later: Ray Train aborts them.
    """
    sft = cfg.data.dataset == "sft"
    spec = sft_store.spec_for(cfg, plan) if sft else idxmap.spec_for(cfg, plan)
    if not sft:
        for info in idxmap.check(spec):
            log.info("corpus %s: %d documents, %.4g tokens (%s)", info.prefix, info.documents,
                     info.tokens, info.dtype)
    cfg = _starting_point(cfg, plan)
    started = connect(cfg)
    # ray job stop sends SIGTERM: the workers save and stop (then, or before training starts,
    # it is Ctrl-C: Ray Train's abort of the worker group). Only the main thread can set
    # handlers (a launch from another thread, as in tests, keeps the default).
    token = uuid.uuid4().hex
    graceful = _GracefulStop(checkpoint.save_root(cfg) / f"{_STOP}{token}",
                             cfg.checkpoint.stop_timeout_s)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, graceful) if main else None
    try:
        check_capacity(cfg)
        backend = _resolve_backend(cfg)
        if sft:  # Ray Data tokenizes the JSON shards across the cluster, once per corpus
            rows = _as_config_error(sft_store.prepare, spec)
            log.info("SFT rows: %d train (%d samples needed: %.2f epochs), %d validation",
                     rows["train"], plan.train_samples, plan.train_samples / rows["train"],
                     rows["valid"])
        else:
            samples = _prepare_indices(spec)
            log.info("index cache %s: %d training samples for %d needed, %d validation for %d",
                     spec.index_cache_dir, samples["train"], plan.train_samples,
                     samples["valid"], plan.valid_samples)
        ray.data.DataContext.get_current().enable_progress_bars = False  # log lines, not bars
        # Ray Train passes this from the driver to its controller: how long a new worker group
        # may take to start before the controller decides again (elastic: after a node loss
        # it may first try the old size while Ray still counts the lost node).
        if _START_TIMEOUT_ENV not in _ENV_AT_IMPORT:  # the user's own setting wins
            os.environ[_START_TIMEOUT_ENV] = f"{cfg.cluster.group_start_timeout_s:g}"
        trainer = build_trainer(cfg, plan, backend, spec, token=token)
        graceful.training = True
        try:
            result = trainer.fit()
        except SystemExit:  # Ray Train's SIGINT handler aborts the workers, then exits
            raise KeyboardInterrupt from None
        finally:
            graceful.training = False
            graceful.stop_file.unlink(missing_ok=True)
        if result.error is not None:
            raise result.error
        final = result.return_value or {}
        if "stopped_at" in final:
            log.warning("stopped at iteration %d of %d with a checkpoint: run the same config "
                        "again to resume", final["stopped_at"], plan.train_iters)
        if sft:  # the end-of-run account of the records: read, used, dropped and why
            final["data"] = sft_store.summaries(spec)
            for split in final["data"].values():
                log.info("%s", split["line"])
        return final
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
        if started:
            ray.shutdown()


def _starting_point(cfg: RunConfig, plan: Plan) -> RunConfig:
    """Check the checkpoint settings and log where the run starts; returns ``cfg`` with
    ``checkpoint.load`` made absolute (the controller and the workers run elsewhere)."""
    checkpoint.check_config(cfg)
    if cfg.checkpoint.load:
        load = str(Path(cfg.checkpoint.load).expanduser().resolve())
        cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, load=load))
    try:
        resume = checkpoint.resume_point(cfg)
    except checkpoint.CheckpointError as err:
        raise ConfigError(str(err)) from None
    if resume is None:
        log.info("no checkpoint in %s: training from scratch", checkpoint.save_root(cfg))
    else:
        log.info("starting from %s%s at iteration %d (%d samples consumed)", resume.path,
                 " (weights only)" if resume.weights_only else "", resume.iteration,
                 resume.iteration * cfg.training.global_batch_size)
        if resume.iteration >= plan.train_iters:
            log.warning("the run in %s is already complete (iteration %d of %d): nothing to "
                        "train; use another output.dir or raise the training length",
                        checkpoint.save_root(cfg), resume.iteration, plan.train_iters)
    return cfg


def _as_config_error(fn, *args):
    """Bad data found while preparing it is the user's to fix: a ConfigError, not a traceback."""
    from ray_ppu.data.preprocess import PreprocessError

    try:
        return fn(*args)
    except (PreprocessError, ValueError) as err:
        raise ConfigError(str(err)) from None


def _prepare_indices(spec: idxmap.SampleSpec) -> dict:
    """Megatron's indices built by one Ray task (never by every rank at once), timed."""
    start = time.perf_counter()
    try:
        samples = ray.get(_prepare_index.remote(spec))
    except ray.exceptions.RayTaskError as err:
        cause = err.as_instanceof_cause()
        if isinstance(cause, ValueError):  # the corpus cannot give what the run asks
            raise ConfigError(str(cause.args[0] if cause.args else cause)) from None
        raise
    log.info("Megatron sample indices ready in %.1f s", time.perf_counter() - start)
    return samples


def _resolve_backend(cfg: RunConfig) -> devices.Backend:
    """The device backend, decided where the workers will run (a node holding PPUs)."""
    c = cfg.cluster
    probe = ray.remote(devices.resolve).options(
        num_cpus=0, resources={c.resource_name: c.ppu_per_worker}
    )
    try:
        return ray.get(probe.remote(c.device), timeout=c.placement_timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise ClusterError(
            f"no node could take one worker's {c.ppu_per_worker:g} {c.resource_name} within "
            f"{c.placement_timeout_s:g} s (cluster.placement_timeout_s)"
        ) from None
