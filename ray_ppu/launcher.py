"""The driver side: Ray cluster, preflight checks, and the Ray Train TorchTrainer.

With ``ray_ppu.ray_worker`` and ``ray_ppu.data.ray_stream``, the only modules that import
Ray. Workers run
:func:`ray_ppu.ray_worker.train_worker`, which adapts Ray Train to the Ray-free
:func:`ray_ppu.worker.run`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import signal
import threading
import time
import uuid
from pathlib import Path

import ray
import ray.train
from ray.train import FailureConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

from ray_ppu import checkpoint, devices, ray_worker, recovery
from ray_ppu.config.loader import ConfigError
from ray_ppu.config.schema import RunConfig
from ray_ppu.data import idxmap, sft_store
from ray_ppu.data.order import valid_steps
from ray_ppu.data.ray_stream import IdxmapDataConfig, steps_dataset
from ray_ppu.plan import ParallelDims, Plan

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


class FailureRecorder(ray.train.UserCallback):
    """Runs in the Ray Train controller: writes down each worker-group failure (cause, ranks,
    time) for the next group's rank 0 to report as a restart (ray_ppu.recovery)."""

    def __init__(self, root: Path, token: str) -> None:
        self.root, self.token = root, token

    def after_exception(self, run_context, worker_exceptions: dict) -> None:
        failure = recovery.record_failure(self.root, self.token, worker_exceptions)
        log.warning("worker group failed (%s); Ray Train restarts it if "
                    "cluster.max_failures allows", failure.cause)


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
        ray_worker.train_worker,
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
       Preflight on every PPU node (:mod:`ray_ppu.preflight`): output, index cache, data and
       checkpoint paths, Transformer Engine and the device, before anything is placed.
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
    graceful = _GracefulStop(checkpoint.save_root(cfg) / f"{ray_worker.STOP}{token}",
                             cfg.checkpoint.stop_timeout_s)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, graceful) if main else None
    try:
        check_capacity(cfg)
        from ray_ppu import preflight  # (it imports this module's ClusterError)

        backend = _backend(preflight.check(cfg))
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


def _backend(preflight_result: dict) -> devices.Backend:
    """The device backend, as the preflight resolved ``cluster.device`` on the PPU nodes (where
    the workers will run); nodes that disagree are an error naming them."""
    found = {r["device"]: r["node"] for r in preflight_result["nodes"]}
    if len(found) != 1:
        raise ClusterError("cluster.device resolves differently across the PPU nodes: "
                           + ", ".join(f"{device} on {node}" for device, node in found.items())
                           + "; set cluster.device explicitly or fix the nodes' drivers")
    return next(iter(found))
